"""What the D2H/H2D "link" is on the machine a profile describes, and what the dashboard's
overlap figures mean there (docs/jupyter.md, "What the figures mean on your machine").

The same numbers read differently per machine: on a Superchip (GH200, GB200) gradients and
weights cross NVLink-C2C (several hundred GB/s per direction on a GH200: the "gh200" preset,
docs/DESIGN.md §1), so the copies rarely limit and the question is whether the Grace CPU's Adam
step hides under the GPU's backward; on a PCIe host (~55 GB/s per direction) the copies
themselves can be what the GPU waits for; on a CPU-only machine there is no link (a "transfer"
is a memory copy) and the model and the "CPU" optimizer share the same cores, so a ratio only
moves work between threads and says nothing about a GPU machine. Pure: a profile in, words out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    """"NVLink-C2C", "PCIe", "unified memory" or "memory copy"."""
    meaning: str
    """What "CPU step hidden" and "device idle" mean over this link (one sentence)."""
    cpu_only: bool = False
    """No GPU: the "device" is the CPU itself."""


CPU_ONLY_NOTE = ("note: CPU-only machine: model and optimizer share these cores; what a ratio "
                 "does here says little about a GPU machine")
"""The plain sentence a CPU-only run's status keeps in view (one line at 1366 px; the link
line in the details says what the overlap figures mean here, and the tuner on a GPU profile
judges a ratio)."""

_SUPERCHIP = ("gh200", "gb200", "grace")


def link_of(profile: Any) -> Link | None:
    """The link of the machine `profile` (a `plan.HardwareProfile`) describes; None without
    a profile. Read from the profile's own fields: `device_type` ("cpu": no GPU),
    `shared_memory` (one memory for both sides: an APU) and the device and CPU names (a
    Grace host is a Superchip's)."""
    if profile is None:
        return None
    names = " ".join(str(getattr(profile, k, "")) for k in ("name", "device_name", "cpu_name"))
    if getattr(profile, "device_type", "cuda") == "cpu":
        return Link("memory copy", "CPU step hidden = the share of the optimizer's step that "
                    "ran while the model computed on other threads of the same CPU; device "
                    "idle = the time the model's thread waited for it", cpu_only=True)
    if any(k in names.lower() for k in _SUPERCHIP):
        return Link("NVLink-C2C", "gradients and weights cross NVLink-C2C, which rarely "
                    "limits: CPU step hidden = the share of the Grace CPU's Adam step that ran "
                    "under the GPU's backward; device idle = GPU time spent waiting for it")
    if getattr(profile, "shared_memory", False):
        return Link("unified memory", "CPU and GPU share one memory, so D2H/H2D move no bytes "
                    "over a link: CPU step hidden = the share of the CPU step under GPU "
                    "compute; device idle = GPU time spent waiting for it")
    return Link("PCIe", "gradients and weights cross PCIe, whose copies can be what the GPU "
                "waits for: CPU step hidden = the share of the CPU step under GPU compute; "
                "device idle = GPU time spent waiting for the copies or the CPU step")
