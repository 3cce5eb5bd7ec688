"""Refuse a simulation that would not fit in memory, before anything is allocated.

`simulate --layers 100000 --hidden 100000 --heads 100` grew to 24 GB and was killed: the
planner works per parameter tensor (the engine's bucket table, plan/buckets.py) and per layer
(the compute lane's Python loop), so its memory grows with those counts, not with the
parameter count itself. The estimate below is an upper bound from the shape alone (every
parameter tensor its own bucket), with per-item costs measured on CPython 3.12 / NumPy 2
(tests/test_plan_size_limit.py keeps it an upper bound on a real run).
"""

from __future__ import annotations

from typing import Any, Protocol

MAX_SIMULATION_BYTES = 1 << 30
"""What one simulation may use (1 GiB; the project's machines are shared)."""
N_RUNS = 2
"""Simulated runs per call: the steady state and one clipped iteration."""
N_ITER = 4
"""Iterations per run (plan/simulator.py)."""
BYTES_PER_TENSOR = 1200
"""Per parameter tensor: its ParamSpec, bucket membership and per-parameter arrays, and a
bucket's arrays and span chunks over N_RUNS x N_ITER iterations (measured ~700 B, doubled)."""
BYTES_PER_LAYER = 4000
"""Per layer: the compute lane's lists (start, end, kind, waits) over N_RUNS x N_ITER
iterations in both directions (measured ~2 kB, doubled)."""


class SimulationTooLarge(ValueError):
    """The simulation of this shape would not fit in memory; the message names the sizes."""


class Sized(Protocol):
    """What the estimate reads of a ``plan.shapes.ModelShape`` (a protocol, so that the HF
    config reader, which shapes.py imports, can check its counts here without a cycle)."""

    @property
    def layers(self) -> int: ...

    @property
    def hidden(self) -> int: ...

    @property
    def n_param_tensors(self) -> int: ...

    @property
    def params(self) -> int: ...


def counts_bytes(n_param_tensors: int, layers: int) -> float:
    """Upper bound of the memory one ``simulate`` of a model with these counts uses."""
    return n_param_tensors * BYTES_PER_TENSOR + (layers + 2) * BYTES_PER_LAYER


def estimate_bytes(shape: Sized) -> float:
    """Upper bound of the memory one ``simulate`` of `shape` uses (module docstring)."""
    return counts_bytes(shape.n_param_tensors, shape.layers)


def check_size(shape: Sized, config: Any = None,
               limit_bytes: float = MAX_SIMULATION_BYTES) -> None:
    """Raise SimulationTooLarge when simulating `shape` would need more than `limit_bytes`."""
    need = estimate_bytes(shape)
    if need > limit_bytes:
        raise SimulationTooLarge(
            f"ModelShape(layers={shape.layers}, hidden={shape.hidden}) is too large to "
            f"simulate: {shape.n_param_tensors:,} parameter tensors and {shape.layers + 2:,} "
            f"layers would need ~{need / 2**30:.1f} GiB (limit {limit_bytes / 2**30:.1f} GiB; "
            f"{shape.params:.3g} parameters). Use fewer layers: the planner simulates every "
            f"parameter tensor and layer, so its cost grows with those counts")


def check_counts(n_param_tensors: int, layers: int, what: str,
                 limit_bytes: float = MAX_SIMULATION_BYTES) -> None:
    """``check_size`` from the counts alone, before a shape (or its per-layer parameter list)
    exists: ``what`` names where the counts come from (a config's key)."""
    need = counts_bytes(n_param_tensors, layers)
    if need > limit_bytes:
        raise SimulationTooLarge(
            f"{what}: {n_param_tensors:,} parameter tensors and {layers + 2:,} layers would "
            f"need ~{need / 2**30:.1f} GiB to simulate (limit {limit_bytes / 2**30:.1f} GiB). "
            f"Use fewer layers: the planner simulates every parameter tensor and layer")
