"""The tuner's pure core: settings in, the planner's prediction and the engine changes out.

No widgets here: `OffloadTuner` (tuner.py) is a view that calls these off the UI thread.
The numbers all come from `superoffload.plan.simulator` (docs/planner.md). Which fields have
a control and which the engine takes live are declared once, in `superoffload.config`
(`TUNED_FIELDS`, `RECONFIGURABLE`); an engine says what IT can take as
`engine.reconfigurable` (empty for one that cannot reconfigure while training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from superoffload import config as config_module
from superoffload.config import OffloadConfig
from superoffload.widgets.shared.profile import rank_share

DISPLAY_ORDER = ("ratio", "bucket_bytes", "grad_cast", "param_cast", "weights", "speculation",
                 "cpu_threads")
"""Controls top to bottom (the fields come from config.TUNED_FIELDS)."""
CONTROL_FIELDS: tuple[str, ...] = tuple(
    sorted(config_module.TUNED_FIELDS,
           key=lambda n: DISPLAY_ORDER.index(n) if n in DISPLAY_ORDER else len(DISPLAY_ORDER)))
"""OffloadConfig fields the tuner's controls set, in display order."""

DROPDOWNS: dict[str, tuple[str, ...]] = {
    name: config_module.choices_of(name) for name in CONTROL_FIELDS
    if name in config_module.CHOICES}
"""A dropdown per tuned choice field, its options the field's ``Literal`` (config.py)."""
LABELS = {
    "ratio": "ratio (CPU share of the optimizer)",
    "bucket_bytes": "bucket size",
    "grad_cast": "gradients cast on",
    "param_cast": "weights cast on",
    "weights": "weight policy",
    "speculation": "speculation (STV)",
    "cpu_threads": "CPU optimizer threads",
}
"""Control label per field (the tuner's rows, its static page)."""

_KiB = 1 << 10
_MiB = 1 << 20
_GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Prediction:
    """The planner's verdict on one setting."""

    iteration_s: float
    tflops: float
    device_bytes: float | None
    host_bytes: float | None
    baseline_s: float | None
    """ZeRO-Offload on the same model and machine (None when not simulated)."""
    fits: bool | None
    """Whether both memories hold the state (None when the planner does not say)."""
    problems: tuple[str, ...] = ()
    """Why it does not fit, with the capacity (the planner's words)."""
    tokens: int | None = None
    """Tokens per iteration (for tokens/s)."""
    effective_ratio: float | None = None
    """The ratio the schedule runs (weight-flow offloads every bucket: 1.0)."""
    device_capacity_bytes: float | None = None
    host_capacity_bytes: float | None = None
    profile_name: str = ""
    calibrated: bool = False
    """Whether the profile's compute rate was fitted to a measured run of the engine
    (``plan.calibrate.calibration_state``); uncalibrated figures are presets' or
    microbenchmarks' (docs/planner.md, "Accuracy")."""
    calibration: str = ""
    """One line saying which (for a view)."""
    baseline_why: str = ""
    """Why it is faster or slower than ZeRO-Offload here, from the two simulated schedules
    (`baseline_why`)."""

    @property
    def speedup_vs_baseline(self) -> float | None:
        if self.baseline_s is None or self.iteration_s <= 0:
            return None
        return self.baseline_s / self.iteration_s


def predict(shape: Any, profile: Any, config: OffloadConfig, *, baseline_s: float | None = None,
            baseline: Any = None) -> Prediction:
    """Simulate one SuperOffload iteration of `shape` on `profile` with `config`; `baseline`
    (the ZeRO-Offload `SimResult`, `baseline_result`) adds the comparison and its reason."""
    from superoffload import plan
    from superoffload.plan.calibrate import calibration_state
    from superoffload.plan.memory import DEVICE_HEADROOM, HOST_HEADROOM

    res = plan.simulate(shape, profile, system="superoffload", config=config)
    state = calibration_state(profile)
    device, host = predicted_memory_bytes(res.memory)
    # res.memory is one rank's: so is the room it is shown against (a node's whole host
    # memory would make an 8-GPU server's rank look 8x roomier than the planner judged it)
    share = rank_share(profile, shape)
    dev_cap = getattr(share, "device_memory_bytes", None)
    host_cap = getattr(share, "host_memory_bytes", None)
    return Prediction(
        iteration_s=float(res.iteration_s), tflops=float(res.tflops), device_bytes=device,
        host_bytes=host, fits=_fits(res),
        baseline_s=float(baseline.iteration_s) if baseline is not None else baseline_s,
        baseline_why=baseline_why(res, baseline, profile) if baseline is not None else "",
        problems=tuple(getattr(res, "problems", ()) or ()), tokens=int(shape.tokens),
        effective_ratio=_number(getattr(res, "plan", None), ("ratio",)),
        device_capacity_bytes=float(dev_cap) * DEVICE_HEADROOM if dev_cap else None,
        host_capacity_bytes=float(host_cap) * HOST_HEADROOM if host_cap else None,
        profile_name=str(getattr(profile, "name", "")), calibrated=state.calibrated,
        calibration=state.text,
    )


def baseline_result(shape: Any, profile: Any) -> Any:
    """The ZeRO-Offload schedule's simulation, the paper's point of comparison (None when it
    cannot be simulated: the baseline may not fit where ours does)."""
    from superoffload import plan

    try:
        return plan.simulate(shape, profile, system="zero-offload", config=None)
    except ValueError:
        return None


_LANE_WORDS = {
    "device_compute": "device compute",
    "d2h": "gradient copies out (D2H)",
    "cpu_optimizer": "CPU optimizer",
    "h2d": "weight copies in (H2D)",
    "device_optimizer": "the GPU tail buckets stepped on the device",
    "storage": "optimizer state read from and written back to storage",
}


def baseline_why(ours: Any, zero: Any, profile: Any) -> str:
    """Why SuperOffload's iteration is shorter or longer than ZeRO-Offload's, read off the two
    simulated schedules (paper §4.2: ZeRO-Offload steps every bucket on the CPU after
    backward, so the device waits for the whole CPU step; SuperOffload steps buckets under
    backward and keeps the last ones on the device)."""
    def busy_ms(res: Any, lane: str) -> float:
        return 1e3 * float(getattr(res.lanes.get(lane), "busy_s", 0.0))

    def idle_ms(res: Any) -> float:
        return 1e3 * float(getattr(res.lanes.get("device_compute"), "idle_s", 0.0))

    if float(ours.iteration_s) <= float(zero.iteration_s):
        text = (f"ZeRO-Offload steps every bucket on the CPU after backward, so the device waits "
                f"{idle_ms(zero):.3g} ms per iteration; SuperOffload steps them under backward "
                f"(device idle {idle_ms(ours):.3g} ms)")
    else:
        lane = max(_LANE_WORDS, key=lambda k: busy_ms(ours, k) - busy_ms(zero, k))
        more = busy_ms(ours, lane) - busy_ms(zero, lane)
        text = (f"SuperOffload adds {more:.3g} ms per iteration of {_LANE_WORDS[lane]} on the "
                f"critical path, more than the {idle_ms(zero) - idle_ms(ours):.3g} ms of device "
                "waiting it saves")
    if getattr(profile, "device_type", "cuda") == "cpu":
        text += ("; the \"device\" here is this CPU (no GPU): model and optimizer share its "
                 "cores, so this says little about a GPU machine")
    return text


def predicted_memory_bytes(memory: Any) -> tuple[float | None, float | None]:
    """(device, host) bytes from a simulation's memory report."""
    return (_number(memory, ("device_bytes", "device_total_bytes", "device")),
            _number(memory, ("host_bytes", "host_total_bytes", "host")))


def _number(obj: Any, names: tuple[str, ...]) -> float | None:
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _fits(res: Any) -> bool | None:
    for owner in (res, getattr(res, "memory", None)):
        value = getattr(owner, "fits", None)
        if isinstance(value, bool):
            return value
    return None


def reconfigurable_fields(engine: Any) -> frozenset[str]:
    """What `engine.reconfigure` takes while training: the engine's own `reconfigurable`
    (empty when it cannot reconfigure), else the config's declared RECONFIGURABLE."""
    return frozenset(getattr(engine, "reconfigurable", config_module.RECONFIGURABLE))


def engine_changes(current: OffloadConfig, wanted: OffloadConfig,
                   allowed: frozenset[str] = config_module.RECONFIGURABLE
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(changes `engine.reconfigure` takes, changes that need a restart) among the tuned
    fields whose value differs."""
    diff = {n: getattr(wanted, n) for n in CONTROL_FIELDS
            if getattr(wanted, n) != getattr(current, n)}
    live = {n: v for n, v in diff.items() if n in allowed}
    restart = {n: v for n, v in diff.items() if n not in allowed}
    return live, restart


def apply_block_reason(engine: Any, allowed: frozenset[str], closed: bool) -> str | None:
    """Why Apply cannot do anything now (None: it can)."""
    if engine is None:
        return "no engine attached (what-if mode): pass engine=... to apply settings"
    if closed:
        return "the engine is closed: nothing can take new settings"
    if not allowed:
        return (f"{type(engine).__name__} cannot reconfigure while training: restart it with "
                "the settings")
    return None


def setting_notes(values: dict[str, Any]) -> list[str]:
    """What a combination of settings does that the controls alone do not show."""
    notes = []
    if values.get("weights") == "flow":
        notes.append(f"weight-flow offloads every bucket: the ratio control is ignored (the "
                     f"engine runs ratio 1.0, not {float(values.get('ratio', 1.0)):.2f})")
    return notes


def bucket_options(current_bytes: int) -> list[tuple[str, int]]:
    """Powers of two from 4 KiB to 1 GiB (plus the current value), labelled for a slider."""
    sizes = sorted({1 << k for k in range(12, 31)} | {int(current_bytes)})
    return [(format_bytes(s), s) for s in sizes]


def format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", _GiB), ("MiB", _MiB), ("KiB", _KiB)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"


def prediction_rows(pred: Prediction) -> list[tuple[str, str, bool | None]]:
    """(label, value, ok) rows of the prediction table; ok is False where it does not fit."""
    rows: list[tuple[str, str, bool | None]] = [
        ("iteration time", format_seconds(pred.iteration_s), None)]
    if pred.tokens:
        rows.append(("tokens/s", f"{pred.tokens / pred.iteration_s:,.0f}", None))
    rows.append(("TFLOP/s", f"{pred.tflops:.3g}", None))
    for side, used, cap in (("device memory", pred.device_bytes, pred.device_capacity_bytes),
                            ("host memory", pred.host_bytes, pred.host_capacity_bytes)):
        if used is None:
            continue
        text, ok = format_gb(used), None
        # no capacity known (a what-if profile without one): the use alone, judged neither way
        if cap is not None:
            text, ok = f"{text} of {format_gb(cap)} usable", used <= cap
        if ok is False:
            text += " · DOES NOT FIT"
        rows.append((side, text, ok))
    speedup = pred.speedup_vs_baseline
    if speedup is not None:
        # a slowdown reads as "Nx slower", never as "0.6x faster"
        versus = f"{speedup:.2f}x faster"
        if speedup < 1:
            versus = f"{1 / speedup:.2f}x slower"
        rows.append(("vs ZeRO-Offload", versus, None))
        if pred.baseline_why:
            rows.append(("why", pred.baseline_why, None))
    if pred.effective_ratio is not None:
        rows.append(("ratio that runs", f"{pred.effective_ratio:.2f}", None))
    rows.append(("calibrated", "yes: fitted to a run of the engine" if pred.calibrated else
                 "no: expect it within 2x until the engine has run (docs/planner.md)", None))
    if pred.fits is False:
        why = "; ".join(pred.problems) or "the planner says it does not fit"
        rows.append(("DOES NOT FIT", why, False))
    return rows


def prediction_text(pred: Prediction) -> str:
    """One plain-text line: the rows joined (what terminals and summaries show)."""
    return " · ".join(f"{label} {value}" if label != "DOES NOT FIT" else f"DOES NOT FIT: {value}"
                      for label, value, _ in prediction_rows(pred))


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"
