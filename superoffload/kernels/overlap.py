"""Memory-range checks of a kernel call: what one call writes must not overlap (issue 12 §6).

The kernel walks every tensor once and writes ``params``, ``exp_avgs``, ``exp_avg_sqs`` and
``params_lp`` in place while it reads ``grads``. Identity is not enough to decide whether
two arguments may share memory: views of one storage at different offsets, a bf16 copy
overlapping its fp32 master by one element, or the same tensor twice in one multi call all
have distinct tensor objects (or distinct ``data_ptr()``) and would be computed wrongly (a
later element reads a value an earlier one already rewrote). So the check compares BYTE
RANGES ``[data_ptr, data_ptr + numel * element_size)`` of contiguous tensors:

* no two written ranges may overlap (same tensor twice included);
* no gradient may overlap a written range;
* gradients may overlap each other: the kernel only reads them, so two aliasing gradients
  (a tied weight's grad passed twice, say) compute exactly what they would as copies.
  ``torch._foreach_*`` ops allow the same.

Sorting the written ranges is O(n log n) for n tensors, done once per prepared call
(kernels/prepared.py); a gradient is then checked by bisection in O(log n), so a call that
brings new gradients each step (CPUAdam with ``zero_grad(set_to_none=True)``) pays
O(n log n) per step, not O(n^2).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

_FIX = ("every tensor a call writes (params, exp_avgs, exp_avg_sqs, params_lp) needs memory "
        "of its own, and a grad must not alias any of them; pass .clone()d tensors")


@dataclass(frozen=True, slots=True)
class WrittenRanges:
    """The disjoint byte ranges a call writes, sorted by start (so also by end)."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    owners: tuple[tuple[str, int], ...]
    """(list name, index) of each range: "exp_avgs", 3 -> exp_avgs[3]."""

    def name(self, k: int) -> str:
        return f"{self.owners[k][0]}[{self.owners[k][1]}]"


def _error(a: str, b: str) -> ValueError:
    return ValueError(f"{a} and {b} share memory (their byte ranges overlap): {_FIX}")


Span = tuple[str, Sequence[int], Sequence[int], int]
"""(list name, data pointers, element counts, element size) of one list of tensors."""


def written_ranges(lists: Sequence[Span]) -> WrittenRanges:
    """Sort the written tensors' ranges and refuse any overlap; empty tensors take no
    memory. One sort of (start, end, list, index) tuples: O(n log n)."""
    spans = sorted((start, start + n * size, li, i)
                   for li, (_, ptrs, numels, size) in enumerate(lists)
                   for i, (start, n) in enumerate(zip(ptrs, numels)) if n)
    # Sorted by start, and every range before the current one is disjoint from its
    # predecessors (we stop at the first overlap), so the previous range has the largest
    # end so far: comparing neighbours finds any overlap.
    for k in range(1, len(spans)):
        if spans[k][0] < spans[k - 1][1]:
            a, b = spans[k - 1], spans[k]
            raise _error(f"{lists[a[2]][0]}[{a[3]}]", f"{lists[b[2]][0]}[{b[3]}]")
    return WrittenRanges(tuple(sp[0] for sp in spans), tuple(sp[1] for sp in spans),
                         tuple((lists[sp[2]][0], sp[3]) for sp in spans))


def check_read_only_ranges(written: WrittenRanges, name: str, starts: Sequence[int],
                           numels: Sequence[int], element_size: int | Sequence[int]) -> None:
    """Refuse a read-only tensor (a grad) that overlaps anything the call writes, from its
    already read pointer and length (one element size for all, or one per tensor): O(log n)
    per tensor by bisection in the sorted written ranges."""
    w_starts, w_ends = written.starts, written.ends
    if not w_starts:
        return
    sizes = [element_size] * len(starts) if isinstance(element_size, int) else element_size
    for i, (start, n, size) in enumerate(zip(starts, numels, sizes)):
        if n:
            end = start + n * size
            k = bisect_left(w_starts, end) - 1  # the written range starting last before end
            if k >= 0 and w_ends[k] > start:
                raise _error(f"{name}[{i}]", written.name(k))
