"""Where are we running? Which widget libraries are importable? Output from threads. Can the
kernel hear the browser now?

The widgets degrade instead of failing: without plotly they explain what to install;
without ipywidgets/anywidget (plotly's FigureWidget is an anywidget since plotly 6) they draw
a static figure; outside a notebook they print a text summary and point at `to_html(path)`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

CI_ENV = "SUPEROFFLOAD_NOTEBOOK_CI"
"""Set to 1 to run a notebook's short CI path, 0 to force the live path (a person's)."""

INSTALL_HINT = "pip install 'superoffload[notebooks]'  (jupyterlab, ipywidgets, plotly, anywidget)"


class WidgetsUnavailable(RuntimeError):
    """Raised when a view needs a library that is not installed; the message says which."""


def notebook_ci() -> bool:
    """True when a notebook should take its short, non-interactive CI path.

    `SUPEROFFLOAD_NOTEBOOK_CI=1` (or 0) decides; unset, it is True when pytest runs this
    process or started its kernel (nbval: the kernel inherits PYTEST_CURRENT_TEST from the
    pytest process), so `pytest --nbval-lax notebooks tutorials` is fast without changing
    what a person running the notebook sees.
    """
    value = os.environ.get(CI_ENV, "").strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    return "PYTEST_CURRENT_TEST" in os.environ


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def plotly_available() -> bool:
    return has_module("plotly")


def live_widgets_available() -> bool:
    """True when a live FigureWidget and ipywidgets controls can be built."""
    return all(has_module(m) for m in ("plotly", "ipywidgets", "anywidget"))


def missing_for_live() -> list[str]:
    return [m for m in ("plotly", "ipywidgets", "anywidget") if not has_module(m)]


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widget front-ends can render)."""
    ipython = _get_ipython()
    return ipython is not None and getattr(ipython, "kernel", None) is not None


def require_plotly(what: str) -> None:
    if not plotly_available():
        raise WidgetsUnavailable(f"{what} needs plotly, which is not installed: {INSTALL_HINT}")


def _get_ipython() -> Any:
    mod = sys.modules.get("IPython")
    if mod is None:
        return None
    try:
        return mod.get_ipython()
    except Exception:
        # IPython half-imported or shutting down
        return None


def on_kernel_shutdown(fn: Callable[[], object]) -> bool:
    """Call `fn()` when the front-end asks this kernel to shut down or restart, before the
    kernel replies; True when hooked. The reply lets the server tear the kernel's channels
    down, so output sent later (from an ``atexit`` hook) can be lost on the way: measured,
    a kernel that exits within half a second of the request lost it 3 times in 8.
    ipykernel's ``Kernel.do_shutdown`` is the documented override for "things to do when the
    front-end shuts the kernel down"; this wraps the running kernel's, once per function."""
    kernel = getattr(_get_ipython(), "kernel", None)
    original = getattr(kernel, "do_shutdown", None)
    if kernel is None or original is None:
        return False
    hooked = getattr(original, "superoffload_hooks", None)
    if hooked is None:
        hooked = []

        def do_shutdown(*args: Any, **kwargs: Any) -> Any:
            for hook in list(hooked):
                # the shutdown itself must go on
                with contextlib.suppress(Exception):
                    hook()
            with contextlib.suppress(Exception):
                # waits until IOPub sent what the hooks displayed
                sys.stdout.flush()
            return original(*args, **kwargs)

        do_shutdown.superoffload_hooks = hooked  # type: ignore[attr-defined]
        kernel.do_shutdown = do_shutdown
    if fn not in hooked:
        hooked.append(fn)
    return True


def capture_output_parent() -> Any:
    """The parent message of the cell running now, or None outside a kernel.

    Call it in the cell that starts a thread and hand the result to `bind_thread_output`
    in that thread: otherwise what the thread prints lands in whichever cell runs next
    (ipykernel routes output by the parent header of the *current* request).
    """
    ipython = _get_ipython()
    if ipython is None or getattr(ipython, "kernel", None) is None:
        return None
    try:
        return ipython.get_parent()
    except Exception:
        # an IPython without get_parent: nothing to route
        return None


def bind_thread_output(parent: Any) -> None:
    """Route this thread's prints and displays to the cell whose `parent` was captured."""
    ipython = _get_ipython()
    if parent is None or ipython is None:
        return
    # ipykernel >= 7: this thread only
    setter = getattr(ipython, "set_thread_parent", None)
    if setter is not None:
        setter(parent)
    elif hasattr(ipython, "set_parent"):
        ipython.set_parent(parent)


def kernel_can_hear() -> bool:
    """False while a cell runs on the kernel's main thread (e.g. `trainer.train()` holding its
    cell): messages from the browser (a widget saying it started, a button press) wait in
    the kernel's queue until the cell ends, so their absence then says nothing. Read from the
    main thread's stack: IPython runs a cell in `InteractiveShell.run_cell`."""
    if _get_ipython() is None:
        return False
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None:
        if frame.f_code.co_name in ("run_cell", "run_cell_async", "run_ast_nodes") and \
                "interactiveshell" in frame.f_code.co_filename:
            return False
        frame = frame.f_back
    return True
