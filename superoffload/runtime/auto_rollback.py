"""When the inverse rollback is exact enough, and what to keep when it is not (docs/engine.md,
"The default rollback").

Legend: g = the gradient the kernel reads (grad * grad_scale, + wd * p in L2 mode), m, v =
the moments before the speculative step, t = (1-b2) g^2, u = 2^-24 (fp32 unit roundoff),
rho = t / (b2 v): how much the rejected step's second-moment term outweighs the history.

The kernel's inverse (cext/so_adam_body.h, DESIGN.md §4) recovers ``m = (m' - (1-b1) g) / b1``
and ``v = (v' - t) / b2`` by subtraction from the post-step moments, one rounding per
operation and the same rounded products as the step, so to first order in u

    |dv| <= u v (4 + rho)                     (the rounding of v' = b2 v + t, relative to b2 v)
    |dm| <= 4 u |m| + u (1-b1)/b1 |g|
    |dp| <= 3 u |p|                           (independent of g; negligible)

and the next update lr * m / sqrt(v) (and the replay's, whatever the clip coefficient c,
since the replay only adds c^2 t >= 0 to b2 v) moves, in units of that update, by at most

    B(rho) = u (6 + rho / 2 + kappa sqrt(rho)) (1 + u rho),   kappa = (1-b1)/b1 sqrt(b2 / (1-b2))

(|m| <= sqrt(v) taken as the scale of m; the last factor covers the curvature of 1/sqrt(v) once u
rho is no longer small: measured within 0.2% of the bound at rho = 1e6). The bound depends on the
clip coefficient only through the worst case c -> 0 (a skipped step, or a replay with a tiny
coefficient), which is what the engine must assume: it decides *before* the speculative step, when c
is not known yet. An element whose v and m are both exactly 0 is restored exactly (v' = t and m' =
(1-b1) g are then the very products the inverse subtracts), except in L2 mode, where the inverse
rebuilds g from the restored p.

``rollback="auto"`` (the default) therefore, per speculated bucket:

1. does not speculate a bucket whose own gradient norm already exceeds ``max_grad_norm``:
   the global norm is at least as large, the step will be clipped, so the speculative step
   would only be undone (settle steps it once, after the verdict: exact and cheaper);
2. checks every element's rho against ``rho_limit`` (B(rho) <= INVERSE_TOLERANCE) and keeps
   exact pre-step copies of the elements beyond it (``Rescue``), restored after the inverse.
   The copies ride on the step's result and are dropped with the iteration: host memory is
   ~16 B per such element while the iteration is open (whole parameters, 12 B/param, when
   more than ``DENSE_FRACTION`` of a bucket is beyond: the first few steps);
3. never speculates with bf16 moments under clipping (their stochastic rounding makes the
   inverse ~2^-8 off) nor with b1 = 0 or b2 = 0 (the inverse divides by them): decided from
   the configuration, so every data-parallel rank decides the same.

Measured (``python benchmarks/rollback_accuracy.py``, docs/engine.md): clip ratios 1 to 1e6
and max_grad_norm down to 1e-4 match AdamW + clip_grad_norm_ to ~1e-7 relative.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from superoffload import kernels
from superoffload.kernels import AdamHyper
from superoffload.runtime.state_overflow import Call

if TYPE_CHECKING:
    from superoffload.runtime.engine_state import BucketBuffers

UNIT_ROUNDOFF = 2.0**-24
INVERSE_TOLERANCE = 1e-6
"""The largest bound B(rho) accepted for an element restored by the inverse (~17 ulp)."""
DENSE_FRACTION = 0.125
"""Above this share of a bucket's elements beyond the limit, whole parameters are kept (a copy
is cheaper than gathering and scattering most of them; the first steps, when v holds one or
two gradients)."""
# elements per check: the temporaries stay in L2
_CHUNK = 1 << 18


def inverse_bound(rho: float, beta1: float, beta2: float) -> float:
    """B(rho): the inverse rollback's error in units of the next update (module docstring)."""
    kappa = (1 - beta1) / beta1 * math.sqrt(beta2 / (1 - beta2))
    if UNIT_ROUNDOFF * (4 + rho) >= 0.5:
        # v is lost to the rounding of v' = b2 v + t: nothing to bound
        return math.inf
    return UNIT_ROUNDOFF * (6 + rho / 2 + kappa * math.sqrt(rho)) * (1 + UNIT_ROUNDOFF * rho)


def rho_limit(beta1: float, beta2: float, tolerance: float = INVERSE_TOLERANCE) -> float:
    """The largest rho with B(rho) <= tolerance (the positive root of the first-order quadratic
    in sqrt(rho); the (1 + u rho) factor is < 1 + 1e-6 there); 0 when b1 or b2 is 0 or 1."""
    if not (0.0 < beta1 < 1.0 and 0.0 < beta2 < 1.0):
        return 0.0
    kappa = (1 - beta1) / beta1 * math.sqrt(beta2 / (1 - beta2))
    room = tolerance / UNIT_ROUNDOFF - 6
    if room <= 0:
        return 0.0
    # x^2/2 + kappa x - room = 0
    root = -kappa + math.sqrt(kappa * kappa + 2 * room)
    return root * root


def invertible(hyper: AdamHyper) -> bool:
    """The inverse exists at all (it divides by b1, b2 and the decay factor)."""
    return 0.0 < hyper.beta1 < 1.0 and 0.0 < hyper.beta2 < 1.0 and hyper.lr * (
        hyper.weight_decay if hyper.adamw_mode else 0.0) < 1.0


def check_rollback_mode(rollback: str, speculation: str, hypers: Sequence[AdamHyper]) -> None:
    """The inverse alone (``rollback="inverse"``) cannot undo a step whose betas are 0 or 1:
    refuse it up front (at ``initialize`` and whenever param groups change), naming the safe
    modes."""
    if rollback != "inverse" or speculation == "off":
        return
    for k, h in enumerate(hypers):
        if not invertible(h):
            from superoffload.config import ConfigError

            raise ConfigError(
                f"OffloadConfig.rollback='inverse' cannot undo a speculative step of param group "
                f"{k} (betas=({h.beta1:g}, {h.beta2:g}), "
                f"lr*weight_decay={h.lr * h.weight_decay:g}): the inverse divides by b1, b2 and "
                "1 - lr*wd. Use rollback='auto' (the default: such buckets are stepped after "
                "validation) or rollback='snapshot'")


Run = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""1-D views (p, m, v, g, low-precision copy or None) over consecutive parameters of a bucket."""


def flat_runs(master: Sequence[torch.Tensor], exp_avg: Sequence[torch.Tensor],
              exp_avg_sq: Sequence[torch.Tensor], grad: Sequence[torch.Tensor],
              lp: Sequence[torch.Tensor] | None, members: Sequence[int]) -> list[Run]:
    """Group ``members`` (bucket positions) into runs whose views lie end to end in every
    buffer (a bucket's buffers are flat allocations: usually one run per kernel call), so
    the check costs a few tensor ops per run rather than per parameter."""
    arrays = [master, exp_avg, exp_avg_sq, grad] + ([lp] if lp is not None else [])
    groups: list[list[int]] = []
    for pos in sorted(members):
        if groups and groups[-1][-1] == pos - 1 and all(
                a[pos].data_ptr() == a[pos - 1].data_ptr()
                + a[pos - 1].numel() * a[pos - 1].element_size() for a in arrays):
            groups[-1].append(pos)
        else:
            groups.append([pos])
    runs: list[Run] = []
    for g in groups:
        n = sum(master[pos].numel() for pos in g)
        first = g[0]
        views = [torch.as_strided(a[first], (n,), (1,), a[first].storage_offset())
                 for a in arrays]
        runs.append((views[0], views[1], views[2], views[3],
                     views[4] if lp is not None else None))
    return runs


@dataclass(slots=True)
class Rescue:
    """Exact pre-step values of the elements the inverse cannot restore within tolerance
    (truthy: a speculative step returns it as its result, see runtime/steps.py)."""

    targets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]
    """1-D views (p, m, v, low-precision copy or None) the kept values go back into."""
    index: list[torch.Tensor | None]
    """Element indices within each view (int64); None: the whole view."""
    saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(p, m, v) of those elements before the step."""

    @classmethod
    def keep(cls, runs: Sequence[Run], index: Sequence[torch.Tensor], *, dense: bool) -> Rescue:
        """Copy the elements ``index`` of each run (whole runs when ``dense``)."""
        saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        kept: list[torch.Tensor | None] = []
        for (p, m, v, _g, _lp), idx in zip(runs, index):
            if dense:
                saved.append((p.clone(), m.clone(), v.clone()))
                kept.append(None)
            else:
                saved.append((p.index_select(0, idx), m.index_select(0, idx),
                              v.index_select(0, idx)))
                kept.append(idx)
        return cls([(r[0], r[1], r[2], r[4]) for r in runs], kept, saved)

    @property
    def elements(self) -> int:
        return sum(int(s[0].numel()) for s in self.saved)

    def restore(self) -> None:
        """Write the kept values back over what the inverse computed (call after it)."""
        for (pt, mt, vt, lpt), idx, (p, m, v) in zip(self.targets, self.index, self.saved):
            for dst, src in ((pt, p), (mt, m), (vt, v)):
                if idx is None:
                    dst.copy_(src)
                else:
                    dst.index_copy_(0, idx, src)
            # the low-precision copy the inverse wrote from the wrong p
            if lpt is not None:
                if idx is None:
                    lpt.copy_(p)
                else:
                    lpt.index_copy_(0, idx, p.to(lpt.dtype))


def prechecked_risky(run: Run, hyper: AdamHyper, grad_scale: float, limit: float,
                     threads: int | None) -> bool:
    """Whether any element of ``run`` may be beyond the limit: the compiled kernel's one pass
    over g and v (kernels.rollback_risk_multi, cext/so_guard.c) -- the common answer, no, costs
    8 B/param beside the step's 28. L2 mode (g + wd p) and bf16 moments go to ``risky``."""
    p, m, v, g, _lp = run
    if (not hyper.adamw_mode and hyper.weight_decay != 0.0) or v.dtype != torch.float32 \
            or limit <= 0.0 or g.dtype not in (torch.float32, torch.bfloat16):
        return True
    c_v = limit * hyper.beta2 / (1.0 - hyper.beta2)
    return kernels.rollback_risk_multi([g], [v], grad_scale=grad_scale, c_v=c_v,
                                       threads=threads) > 0


def risky(grad: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor,
          exp_avg_sq: torch.Tensor, *, hyper: AdamHyper, grad_scale: float,
          limit: float) -> torch.Tensor | None:
    """Flat indices of the elements of one parameter whose rho exceeds ``limit`` (None: none).

    rho > limit  <=>  g^2 > C v  with  C = limit * b2 / (1-b2); checked as the sign of
    v - g^2 / C in chunks (two passes over g and v, no full-size temporary). Called only where
    ``prechecked_risky`` found some (the first steps, rare features, heavy clipping)."""
    n = grad.numel()
    if n == 0:
        return None
    l2 = not hyper.adamw_mode and hyper.weight_decay != 0.0
    c = limit * hyper.beta2 / (1.0 - hyper.beta2)
    g_flat, v_flat = grad.reshape(-1), exp_avg_sq.reshape(-1)
    p_flat, m_flat = param.reshape(-1), exp_avg.reshape(-1)
    found: list[torch.Tensor] = []
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        g = g_flat[lo:hi]
        if l2:
            g = torch.add(g.float() * grad_scale, p_flat[lo:hi], alpha=hyper.weight_decay)
            scale2 = 1.0
        else:
            scale2 = grad_scale * grad_scale
        v = v_flat[lo:hi]
        if c > 0:
            margin = torch.addcmul(v, g, g, value=-scale2 / c)
        else:
            # no room at all: every element counts as beyond the bound
            margin = -torch.ones_like(v)
        if float(margin.min()) >= 0.0:
            continue
        bad = margin < 0
        # m = v = 0: the inverse subtracts the very products the step added
        if not l2:
            bad &= (v != 0) | (m_flat[lo:hi] != 0)
        idx = bad.nonzero().view(-1)
        if idx.numel():
            found.append(idx + lo)
    if not found:
        return None
    return torch.cat(found)


@dataclass(frozen=True, slots=True)
class AutoRollback:
    """What ``rollback="auto"`` decides in the worker before a bucket's speculative step
    (items 1 and 2 of the module docstring). The training thread has already declined what
    the configuration alone rules out (``may_speculate``, item 3); what depends on the data is
    decided here."""

    max_grad_norm: float | None
    """The configured clipping threshold (a bucket above it alone is certain to clip)."""
    threads: int | None = None
    """The CPU optimizer's threads (the check runs on them)."""

    def protect(self, buf: BucketBuffers, calls: Sequence[Call], grad_scale: float,
                sum_sq: float) -> Rescue | None | bool:
        """False: do not speculate (the verdict will clip: every rank rolls back and replays,
        so declining is consistent over ranks); None: the inverse alone is within its bound;
        a ``Rescue``: the pre-step values of the elements beyond it."""
        clip = self.max_grad_norm
        # the global norm is at least this bucket's (sums of squares only add up)
        if clip and math.sqrt(sum_sq) * grad_scale > clip * (1 + 1e-6):
            return False
        runs: list[Run] = []
        index: list[torch.Tensor] = []
        total = 0
        for call in calls:
            limit = rho_limit(call.hyper.beta1, call.hyper.beta2)
            # the kernel's g: maximize steps along +grad, so its sign flips
            scale = -grad_scale if call.hyper.maximize else grad_scale
            for run in flat_runs(buf.master, buf.exp_avg, buf.exp_avg_sq, buf.grad_host,
                                 buf.lp_host, call.members):
                total += run[0].numel()
                if not prechecked_risky(run, call.hyper, scale, limit, self.threads):
                    # the common case: one read of g and v in C, nothing beyond
                    continue
                idx = risky(run[3], run[0], run[1], run[2], hyper=call.hyper,
                            grad_scale=scale, limit=limit)
                if idx is not None:
                    runs.append(run)
                    index.append(idx)
        if not index:
            return None
        return Rescue.keep(runs, index,
                           dense=sum(int(i.numel()) for i in index) > DENSE_FRACTION * total)


def may_speculate(hypers: Sequence[AdamHyper], moments: torch.dtype, config_rollback: str,
               max_grad_norm: float | None) -> bool:
    """Training thread, at launch: may this bucket be speculated at all? Under "auto", not
    when the inverse does not exist for one of its groups (betas 0 or 1), nor with bf16
    moments under clipping (their stochastic rounding makes the inverse ~2^-8 off): such a
    bucket is stepped once, after the verdict. ``hypers``: those of every param group with a
    parameter in the bucket; decided from them and the configuration alone, so every rank
    decides the same (collective publishes must match)."""
    if config_rollback != "auto":
        return True
    if any(not invertible(h) for h in hypers):
        return False
    return not (max_grad_norm and moments != torch.float32)
