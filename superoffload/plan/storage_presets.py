"""Storage tiers for the hardware presets: arrays of NVMe drives from their spec sheets
(DESIGN.md §7: the planner knows the tier; docs/storage.md).

A tier is the ``HardwareProfile.storage_*`` figures (plan/hardware.py) with their sources.
An array of N drives striped together (RAID 0, or one file per drive) reads and writes N times
one drive's sequential rate and holds N times its capacity: the spec sheets' figures, peaks
of a sequential workload at a deep queue, which the engine's large aligned requests are
(docs/storage.md). ``plan.measure_storage.measure_storage_tier`` replaces them with what the
project's own I/O engine measures on a folder of the machine at hand.

Drives:
  gen4  Samsung PM1733, PCIe Gen4 x4 U.2, 3.84 TB: 6.4 GB/s sequential read, 3.8 GB/s
        sequential write (Samsung's PM1733 announcement; the U.2 drive NVIDIA's DGX servers
        carry at 3.84 TB)
  gen5  Samsung PM1743, PCIe Gen5 x4, 7.68 TB: 13 GB/s sequential read, 6.6 GB/s sequential
        write (Samsung's PM1743 announcement; 1.92 to 15.36 TB)
FACTS.md's anchor agrees in size: ZeRO-Infinity read 10 GB/s from 4 Gen4 drives and up to
48 GB/s from 8 Gen5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 1e9
TB = 1e12


@dataclass(frozen=True, slots=True)
class Drive:
    """One NVMe drive as its spec sheet gives it."""

    name: str
    read_gbps: float
    write_gbps: float
    capacity_bytes: float
    sheet: str
    """Where the figures come from."""


DRIVES = {
    "gen4": Drive("Samsung PM1733 (PCIe Gen4 x4, U.2, 3.84 TB)", 6.4, 3.8, 3.84 * TB,
                  "Samsung PM1733 announcement: U.2 6,400 MB/s sequential read, 3,800 MB/s "
                  "sequential write, 0.96-30.72 TB"),
    "gen5": Drive("Samsung PM1743 (PCIe Gen5 x4, 7.68 TB)", 13.0, 6.6, 7.68 * TB,
                  "Samsung PM1743 announcement: 13,000 MB/s sequential read, 6,600 MB/s "
                  "sequential write, 1.92-15.36 TB"),
}
REQUESTS_PER_DRIVE = 4
"""Requests of 1 MiB in flight per drive the sequential rates need: 4 MiB in flight, what a
queue of 32 requests of 128 KiB (the depth drive benchmarks commonly quote sequential rates
at) keeps in flight -- an estimate until measured (``measure_storage_tier``)."""


def nvme(drives: int, gen: str, *, why: str = "") -> dict[str, Any]:
    """``HardwareProfile`` fields of an array of ``drives`` drives of generation ``gen``
    ("gen4" or "gen5"), with a ``sources`` tuple to merge; ``why``: the reason the preset
    has that many (a datasheet, or an assumption, said so)."""
    if gen not in DRIVES:
        raise ValueError(f"storage tier gen={gen!r}: use one of {', '.join(DRIVES)}")
    if not isinstance(drives, int) or drives < 1:
        raise ValueError(f"storage tier drives={drives!r}: use a whole number >= 1")
    d = DRIVES[gen]
    count = f"{drives} x {d.name}" + (f" ({why})" if why else "")
    spec = f"spec: {drives} x the drive's figure, {d.sheet}; {count}"
    return {
        "storage_read_gbps": drives * d.read_gbps,
        "storage_write_gbps": drives * d.write_gbps,
        "storage_bytes": drives * d.capacity_bytes,
        "storage_queue_depth": drives * REQUESTS_PER_DRIVE,
        "storage_name": f"{drives} x {d.name}",
        "sources": (
            ("storage_read_gbps", spec),
            ("storage_write_gbps", spec),
            ("storage_bytes", spec),
            ("storage_queue_depth", f"estimate: {REQUESTS_PER_DRIVE} requests of 1 MiB in "
                                    "flight per drive (plan/storage_presets.py)"),
        ),
    }


STORAGE_NAMES = tuple(f"nvme-{gen}x{n}" for gen in DRIVES for n in (1, 2, 4, 8))
"""Tiers a command line may name (``--storage``): nvme-gen4x4 is four Gen4 drives."""


def by_name(name: str) -> dict[str, Any]:
    """The tier ``name`` names (``STORAGE_NAMES``), or "none" (no tier: every figure 0)."""
    if name == "none":
        return {"storage_read_gbps": 0.0, "storage_write_gbps": 0.0, "storage_bytes": 0.0,
                "storage_queue_depth": 0, "storage_name": "", "sources": ()}
    if name not in STORAGE_NAMES:
        raise ValueError(f"storage tier {name!r}: use one of none, {', '.join(STORAGE_NAMES)}, or "
                         "measure:FOLDER (measure a folder with the project's I/O engine)")
    gen, n = name[len("nvme-"):].split("x")
    return nvme(int(n), gen)


def with_tier(prof: Any, fields: dict[str, Any]) -> Any:
    """``prof`` (a HardwareProfile) with the tier ``fields`` (``nvme``/``by_name``): its own
    storage sources replaced by the tier's."""
    fields = dict(fields)
    tier_sources = fields.pop("sources")
    kept = tuple((k, v) for k, v in prof.sources if not k.startswith("storage_"))
    return prof.replace(**fields, sources=kept + tuple(tier_sources))
