"""Harness for the real-browser test: a throwaway JupyterLab server and Debian's chromium.

Everything is bounded: the server gets a free port on 127.0.0.1, no token, its own config,
data, runtime and workspace folders, and no network calls (no news, no update check); it is
always terminated (then killed) on exit, with its kernels.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def jupyter_lab(root: Path, *, start_timeout_s: float = 90.0,
                extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """Run JupyterLab on `root`; yield its base URL; always shut it down. Its kernels run the
    notebooks' live path (SUPEROFFLOAD_NOTEBOOK_CI=0: a person's run, not nbval's)."""
    port = free_port()
    home = root.parent / "jupyter-home"
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)  # else the kernels would take the CI path
    env["SUPEROFFLOAD_NOTEBOOK_CI"] = "0"
    env.update(extra_env or {})
    for name, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                      ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(home / sub)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    # no "get notified about news?" toast over the screenshot
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        "--ServerApp.open_browser=False",
        f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands, read state
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
        f"--LabApp.user_settings_dir={home / 'settings'}",
        "--LabApp.extension_manager=readonly",  # no PyPI queries
        "--ServerApp.terminals_enabled=False",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI containers run as root
    log = (root.parent / "jupyter.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {proc.returncode}: see {log.name}")
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"jupyter lab did not answer within {start_timeout_s} s: "
                                   f"see {log.name}")
            time.sleep(0.25)  # waiting on another process's socket: nothing to block on
        yield url
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        # the server's own process group holds its kernels: end them together
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def prepare_notebook(src: Path, dst: Path, *, parameters: dict[str, Any] | None = None,
                     drop_tags: tuple[str, ...] = ()) -> None:
    """Copy a notebook for the browser run: the cell tagged "parameters" gets `parameters`
    appended (papermill's convention; none: the notebook as a person opens it) and cells with
    a tag in `drop_tags` are left out."""
    nb = json.loads(src.read_text())
    cells = []
    found = False
    parameters = parameters or {}
    for cell in nb["cells"]:
        tags = cell.get("metadata", {}).get("tags", [])
        if set(tags) & set(drop_tags):
            continue
        if "parameters" in tags and parameters:
            found = True
            source = "".join(cell["source"])
            extra = "".join(f"\n{k} = {v!r}" for k, v in parameters.items())
            cell["source"] = source.rstrip("\n") + "\n# set by tests/test_browser.py" + extra + "\n"
        cells.append(cell)
    if parameters and not found:
        raise ValueError(f"{src} has no cell tagged 'parameters'")
    nb["cells"] = cells
    dst.write_text(json.dumps(nb, indent=1))


# JavaScript run in the page ----------------------------------------------------------

JS_APP_READY = """() => {
  const app = window.jupyterapp;
  if (!app || !app.shell || !app.shell.currentWidget) return false;
  const w = app.shell.currentWidget;
  return !!(w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel
            && w.sessionContext.session.kernel.connectionStatus === 'connected'
            && w.content && w.content.widgets && w.content.widgets.length > 0);
}"""

JS_RUN_ALL = """async () => {
  await window.jupyterapp.commands.execute('notebook:run-all-cells');
  return true;
}"""

JS_START_RUN_ALL = """() => {
  // does not wait: run-all resolves only when the last cell ends (a cell that trains holds it)
  window.jupyterapp.commands.execute('notebook:run-all-cells');
  return true;
}"""

JS_EXECUTE = """async (code) => {
  // run code in the notebook's kernel (no cell): its stdout comes back
  const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const future = k.requestExecute({code, silent: false, store_history: false});
  let out = '';
  future.onIOPub = (msg) => {
    if (msg.header.msg_type === 'stream') out += msg.content.text;
    const c = msg.content;
    if (msg.header.msg_type === 'error') out += 'ERROR ' + c.ename + ': ' + c.evalue;
  };
  await future.done;
  return out;
}"""

JS_RUN_CELL = """async (index) => {
  // run one cell again (a person's Shift+Enter on it); resolves when it has run
  const app = window.jupyterapp, nb = app.shell.currentWidget;
  nb.content.activeCellIndex = index;
  await app.commands.execute('notebook:run-cell');
  return true;
}"""

JS_RESTART_KERNEL = """async () => {
  // what Kernel > Restart Kernel does once its dialog is confirmed
  await window.jupyterapp.shell.currentWidget.sessionContext.restartKernel();
  return true;
}"""

JS_SAVE_AND_SHUT_DOWN = """async () => {
  const app = window.jupyterapp, w = app.shell.currentWidget;
  await app.commands.execute('docmanager:save');
  await w.sessionContext.shutdown();
  return w.context.path;
}"""

JS_CELL_RUNNING = """(index) => {
  const w = window.jupyterapp.shell.currentWidget;
  const cell = w.content.widgets[index];
  return !!cell && cell.node.querySelector('.jp-InputPrompt').textContent.includes('*');
}"""

JS_KERNEL_STATUS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  return w.sessionContext.session.kernel.status;
}"""

JS_PLOTS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => ({
  title: (gd.layout && gd.layout.title && gd.layout.title.text) || '',
  names: (gd.data || []).map(t => t.name || ''),
  lengths: (gd.data || []).map(t => (t.x ? t.x.length : 0)),
  lastX: (gd.data || []).map(t => {
     if (!t.x || !t.x.length) return null;
     let m = -Infinity; for (let i = 0; i < t.x.length; i++) { const v = Number(t.x[i]);
       if (!Number.isNaN(v) && v > m) m = v; }
     return m === -Infinity ? null : m; }),
}))"""

JS_CELL_ERRORS = """() => Array.from(document.querySelectorAll(
  '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"], '
  + '.jp-RenderedText[data-mime-type="application/vnd.jupyter.error"]'
)).map(e => e.innerText.slice(0, 2000))"""

JS_DASHBOARD = r"""() => {
  // text is read with textContent: JupyterLab's default windowing skips the rendering of
  // off-screen cells, and innerText of a skipped subtree is empty
  const box = document.querySelector('.so-dashboard');
  const status = document.querySelector('.so-dash-status');
  const trainer = document.querySelector('.so-trainer-status');
  const plot = box ? box.querySelector('.so-liveplot') : null;
  const gd = plot ? plot.querySelector('.js-plotly-plot') : null;
  const trace = (name) => {  // _fullData: the arrays as drawn (data may hold base64 specs)
    if (!gd || !gd._fullData) return null;
    const t = gd._fullData.find(d => d.name === name);
    if (!t) return null;
    return {n: t.x ? t.x.length : 0,
            lastX: t.x && t.x.length ? Number(t.x[t.x.length - 1]) : null};
  };
  const text = (e) => e ? e.textContent.replace(/\s+/g, ' ').trim() : '';
  return {
    live: !!gd,
    attached: !!box,
    traces: gd && gd._fullData ? gd._fullData.length : 0,
    draws: plot ? Number(plot.dataset.draws || 0) : 0,
    drawMs: plot ? Number(plot.dataset.drawMs || 0) : 0,
    pending: plot ? (plot.dataset.pending || '') : '',
    stalls: plot ? Number(plot.dataset.stalls || 0) : 0,
    // the first figure with data: when it reached the page, when it was drawn (ms)
    firstDataMs: plot ? Number(plot.dataset.firstDataMs || 0) : 0,
    renderedMs: plot ? Number(plot.dataset.renderedMs || 0) : 0,
    dataToDrawMs: plot && plot.dataset.dataToDrawMs ? Number(plot.dataset.dataToDrawMs) : null,
    // the steps to that first draw (ms since the epoch; liveplot.js's `reached`)
    timeline: plot && plot.dataset.timeline ? JSON.parse(plot.dataset.timeline) : null,
    // plotly.js evaluated once per page: when it started and was ready (ms since the epoch)
    plotlyMs: plot && plot.dataset.plotlyReadyMs
      ? [Number(plot.dataset.plotlyStartedMs), Number(plot.dataset.plotlyReadyMs)] : null,
    fallback: box ? (() => {  // the copy drawn in place when the live figure did not start
      const f = box.querySelector('.so-dash-fallback .js-plotly-plot');
      if (!f || !f._fullData) return null;
      const line = f._fullData.find(t => t.name === 'iteration time' && t.fill !== 'toself');
      return {traces: f._fullData.filter(t => t.x && t.x.length).length,
              points: line && line.x ? line.x.length : 0,
              title: (f.layout.title && f.layout.title.text) || '',
              shown: f.getBoundingClientRect().height > 0}; })() : null,
    status: text(status),
    trainer: trainer ? trainer.textContent : '',
    runs: gd && gd._fullData ? gd._fullData
      .filter(d => /^run\d/.test(d.legendgroup || '') && d.x && d.x.length)
      .map(d => ({name: d.name, axis: d.xaxis, n: d.x.length, x0: Number(d.x[0])})) : [],
    title: gd && gd.layout && gd.layout.title ? (gd.layout.title.text || '') : '',
    measured: trace('iteration time'),
    compute: trace('device compute'),
    shapes: gd && gd.layout && gd.layout.shapes
      ? gd.layout.shapes.map(s => ({xref: s.xref, x0: s.x0})) : [],
    annotations: gd && gd.layout && gd.layout.annotations
      ? gd.layout.annotations.map(a => a.text || '') : [],
  };
}"""

JS_STATIC_PLOTS = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
  .filter(gd => !gd.closest('.so-dashboard'))
  .map(gd => ({title: gd.layout && gd.layout.title ? (gd.layout.title.text || '') : '',
               traces: (gd.data || []).length}))"""

JS_HISTORY = """(live) => {
  // the whole-run series of the dashboard's figure (live or static): the iteration-time and
  // loss lines and their min..max bands, as drawn (_fullData)
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot'))
    .filter(gd => live ? !!gd.closest('.so-dashboard') : !gd.closest('.so-dashboard'))
    .filter(gd => gd._fullData && gd._fullData.some(t => t.name === 'iteration time'));
  if (!plots.length) return null;
  const gd = plots[plots.length - 1];
  const pick = (name, band) => {
    const t = gd._fullData.find(d => d.name === name
                                     && (band ? d.fill === 'toself' : d.fill !== 'toself'));
    return t ? {x: Array.from(t.x || [], Number), y: Array.from(t.y || [], Number)} : null;
  };
  // the newest iteration on the same figure's timeline (its spans' hover text: "... · it N · ...")
  let timeline = -1;
  for (const t of gd._fullData.filter(d => d.xaxis === 'x' && d.text)) {
    for (const label of Array.from(t.text)) {
      const m = /\\bit (\\d+)\\b/.exec(String(label));
      if (m) timeline = Math.max(timeline, Number(m[1]));
    }
  }
  return {title: gd.layout.title.text || '', line: pick('iteration time', false),
          band: pick('iteration time', true), loss: pick('loss', false),
          lossBand: pick('loss', true), timelineNewest: timeline};
}"""

JS_LAYOUT_PROBLEMS = """() => {
  // every plotly figure fits its output area; legends, axis titles, tick labels and
  // annotations stay inside the figure; legends do not overlap one another
  const out = [];
  const inside = (r, b, what) => {
    if (r.width === 0 && r.height === 0) return;
    const box = (q) => [q.left, q.top, q.right, q.bottom].map(Math.round).join(',');
    if (r.left < b.left - 1 || r.right > b.right + 1 || r.top < b.top - 1
        || r.bottom > b.bottom + 1)
      out.push(`${what} [${box(r)}] outside [${box(b)}]`);
  };
  for (const gd of document.querySelectorAll('.js-plotly-plot')) {
    const area = gd.closest('.jp-OutputArea-output') || gd.parentElement;
    const svg = gd.querySelector('svg.main-svg');
    if (!svg) continue;
    const a = area.getBoundingClientRect(), f = svg.getBoundingClientRect();
    if (f.width > a.width + 1)
      out.push(`figure ${Math.round(f.width)} px wider than its output area `
               + `${Math.round(a.width)} px`);
    const legends = Array.from(gd.querySelectorAll('g.legend')).map(l => l.getBoundingClientRect());
    legends.forEach((r, i) => inside(r, f, `legend ${i}`));
    for (let i = 0; i < legends.length; i++) for (let j = i + 1; j < legends.length; j++) {
      const p = legends[i], q = legends[j];
      if (p.width && q.width && p.left < q.right - 1 && q.left < p.right - 1
          && p.top < q.bottom - 1 && q.top < p.bottom - 1)
        out.push(`legends ${i} and ${j} overlap`);
    }
    gd.querySelectorAll('.g-xtitle, .g-ytitle, .annotation, .gtitle, .xtick, .ytick')
      .forEach((e, i) => inside(e.getBoundingClientRect(), f,
                                `${e.getAttribute('class')} ${i} '${e.textContent.slice(0, 40)}'`));
  }
  const texts = '.so-tuner .widget-html-content, .so-tuner .widget-label';
  for (const e of document.querySelectorAll(texts))
    if (e.scrollWidth > e.clientWidth + 1)
      out.push(`tuner text clipped: '${e.textContent.slice(0, 60)}'`);
  // every view fits its output area: no container wider than it, no horizontal scrollbar
  for (const c of document.querySelectorAll('.so-dashboard, .so-tuner, .so-trainer')) {
    const area = c.closest('.jp-OutputArea-output');
    if (!area) continue;
    const a = area.getBoundingClientRect(), r = c.getBoundingClientRect();
    const cls = c.className.split(' ').find(k => k.startsWith('so-'));
    if (r.right > a.right + 1 || r.width > a.width + 1)
      out.push(`${cls} is ${Math.round(r.width)} px wide, ${Math.round(r.right - a.right)} px `
               + `past its output area (${Math.round(a.width)} px)`);
    for (const [what, e] of [['output area', area], ['box', c]])
      if (e.scrollWidth > e.clientWidth + 1)
        out.push(`${cls}'s ${what} scrolls sideways: ${e.scrollWidth} px of content `
                 + `in ${e.clientWidth} px`);
    let right = 0;  // a child wider than the box (a 100 % widget plus its margins) overflows it
    for (const e of c.querySelectorAll('.jupyter-widgets'))
      right = Math.max(right, e.getBoundingClientRect().right);
    if (right > a.right + 1)
      out.push(`${cls} holds a widget ${Math.round(right - a.right)} px past its output area`);
  }
  return out;
}"""

JS_WIDGET_ERRORS = """() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
  .map(e => e.textContent || '')
  .filter(t => t.includes('Error displaying widget') || t.includes('model not found')
               || t.includes('Traceback'))
  .map(t => t.slice(0, 500))"""

JS_OUTPUT_TEXT = """() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
  .map(e => e.textContent || '').join('\\n')"""

JS_ON_SCREEN = """(selector) => {
  // how much of the element the notebook shows now: its box against the notebook's scroller
  const e = document.querySelector(selector);
  const sc = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
  if (!e || !sc) return null;
  const r = e.getBoundingClientRect(), v = sc.getBoundingClientRect();
  return {top: r.top, bottom: r.bottom, height: r.height, viewTop: v.top, viewBottom: v.bottom,
          viewHeight: v.height, inside: r.top >= v.top - 1 && r.bottom <= v.bottom + 1};
}"""

JS_SCROLL_TO_END = """() => {
  const sc = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
  sc.scrollTop = sc.scrollHeight;
  return sc.scrollTop;
}"""

JS_SCROLL_TO_TOP = """() => {
  const sc = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
  sc.scrollTop = 0;
  return sc.scrollTop;
}"""

JS_WATCH_DASHBOARD = """() => {
  // a person watching the dashboard until its first figure with data is drawn: whenever the
  // live figure is out of sight (Run All scrolls on to later cells, cells above render and
  // push it down), it is scrolled back at once, from the page itself: a check from the test
  // takes a round trip and a throttled page's layout to settle, seconds on a loaded machine
  if (window.__soWatching) return false;
  window.__soWatching = true;
  const until = Date.now() + 600000;
  const look = () => {
    const box = document.querySelector('.so-dashboard');
    const plot = box && box.querySelector('.so-liveplot');
    if ((plot && plot.dataset.dataToDrawMs) || Date.now() > until) {
      window.__soWatching = false;
      return;
    }
    const e = plot || box;
    if (e) {
      const r = e.getBoundingClientRect();
      if (r.bottom <= 0 || r.top >= window.innerHeight) e.scrollIntoView({block: 'nearest'});
    }
    setTimeout(look, 50);
  };
  look();
  return true;
}"""
