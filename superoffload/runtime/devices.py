"""Device ops: the device specifics behind one small interface (DESIGN.md §2-3): CPU and CUDA.

The engine runs the same schedule on both. The device ops allocate buffers, copy a bucket's
gradients device->host (computing the bucket's local validation statistics on the way),
copy updated weights host->device, and order the next forward after those copies.

* ``CpuDeviceOps``: the "device" is the CPU; device buffers are ordinary tensors; transfers are
  copies run on the transfer threads; nothing to order (a finished copy is visible).
* ``CudaDeviceOps``: D2H and H2D run on their own ``torch.cuda.Stream``s into pinned, reused
  host buffers; a ``torch.cuda.Event`` recorded on the compute stream when a bucket's
  gradients are final orders the D2H after them; the H2D event is waited on by the compute
  stream (not the host) just before the module that needs the bucket runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from superoffload import kernels


@dataclass(frozen=True, slots=True)
class GradStats:
    """Local validation of one bucket: sum of squares of its (scaled) gradient and the count
    of non-finite elements (DESIGN.md §3 step 2)."""

    sum_sq: float
    nonfinite: int

    def resolve(self) -> GradStats:
        return self


@dataclass(frozen=True, slots=True)
class PendingStats:
    """A CUDA bucket's statistics still on their way: ``resolve()`` waits for the copy and the
    statistics to land (a blocking event: the thread sleeps, it does not spin) and reads them.
    Returning this instead of waiting lets the D2H lane keep several buckets in flight."""

    done: Any
    """A blocking ``torch.cuda.Event`` after the copy and the statistics."""
    host: torch.Tensor
    """Pinned [sum of squares, non-finite count], filled when ``done`` completes."""

    def resolve(self) -> GradStats:
        self.done.synchronize()
        return GradStats(float(self.host[0]), int(self.host[1]))


class DeviceOps(Protocol):
    device: torch.device

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def alloc_device(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """uint8 host memory of exactly ``nbytes`` for a long-lived pool (the storage tier's
        slots), page-locked on CUDA; ``free_pinned`` gives it back."""
        ...

    def free_pinned(self, buffer: torch.Tensor) -> None:
        """Give back a buffer of ``alloc_pinned`` (before it is freed)."""
        ...

    def ready_token(self) -> Any:
        """Called in the thread producing gradients, when a bucket's last one is final."""
        ...

    def d2h(
        self, grads: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], ready: Any
    ) -> GradStats | PendingStats: ...

    def d2h_add(self, grads: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                add: Sequence[bool], ready: Any) -> None:
        """Host accumulation (``OffloadConfig.grad_accum_on="host"``): move ``grads`` into
        the fp32 host buffers ``dst``, adding where ``add`` is True and copying elsewhere
        (a parameter's first micro-step); returns once the host buffers hold the result."""
        ...

    def stream(self, kind: str) -> Any:
        """The device stream of "d2h" or "h2d" work (None: the current one; CPU: None)."""
        ...

    def h2d(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> Any: ...

    def wait(self, token: Any) -> None:
        """Order the next device work after an H2D (its returned token)."""
        ...

    def host_wait(self, token: Any) -> None:
        """Block the calling thread until the H2D whose token this is has read its host
        source (before the source is reused: a storage-tier slot, runtime/tier.py)."""
        ...

    def device_stats(self, grads: Sequence[torch.Tensor]) -> GradStats: ...

    def synchronize(self) -> None: ...


def host_stats(grads: Sequence[torch.Tensor]) -> GradStats:
    """Local statistics with the kernel's fused pass (it reads fp32/bf16; fp16 is widened)."""
    # the C kernel reads contiguous fp32 or bf16 only: anything else goes through a copy
    ok = [g if g.dtype in (torch.float32, torch.bfloat16) and g.is_contiguous()
          else g.float() for g in grads]
    sum_sq, nonfinite = kernels.grad_stats_multi(ok)
    return GradStats(float(sum_sq), int(nonfinite))


def stats_tensor(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[sum of squares, number of non-finite tensors] as a device tensor, no host sync.

    One fused multi-tensor norm (fp32 accumulation); a tensor holding inf/nan has a
    non-finite norm, which is all the verdict needs (then the step is skipped anyway)."""
    if not grads:
        return torch.zeros(2, dtype=torch.float32, device=device)
    norms = torch.stack(torch._foreach_norm(list(grads), 2, dtype=torch.float32))
    finite = torch.isfinite(norms)
    sum_sq = torch.where(finite, norms, 0.0).square().sum()
    return torch.stack([sum_sq, (~finite).sum().float()])


class CpuDeviceOps:
    """The device is the CPU. Same schedule, plain tensors and copies."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def alloc_device(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def free_pinned(self, buffer: torch.Tensor) -> None:
        return None

    def ready_token(self) -> Any:
        # autograd on the CPU has finished the gradient when the hook fires
        return None

    def stream(self, kind: str) -> Any:
        return None

    def d2h(
        self, grads: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], ready: Any
    ) -> GradStats:
        stats = host_stats(grads)
        with torch.no_grad():
            for g, d in zip(grads, dst):
                # casts when the policy moves fp32 (device-side cast)
                d.copy_(g)
        return stats

    def d2h_add(self, grads: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                add: Sequence[bool], ready: Any) -> None:
        with torch.no_grad():
            for g, d, a in zip(grads, dst, add):
                if a:
                    # widens a bf16/fp16 gradient into the fp32 sum
                    d.add_(g)
                else:
                    d.copy_(g)

    def h2d(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> Any:
        with torch.no_grad():
            for s, d in zip(src, dst):
                d.copy_(s)
        return None

    def wait(self, token: Any) -> None:
        return None

    def host_wait(self, token: Any) -> None:
        # the copy ran in the lane's thread
        return None

    def device_stats(self, grads: Sequence[torch.Tensor]) -> GradStats:
        return host_stats(grads)

    def synchronize(self) -> None:
        return None


class CudaDeviceOps:
    """CUDA streams, pinned host memory and events (needs a GPU; tested in test_cuda_engine)."""

    def __init__(self, device: torch.device, *, pin_memory: bool = True) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDeviceOps needs CUDA; use device='cpu' or 'auto'")
        self.device = device
        self.pin_memory = pin_memory
        self.d2h_stream = torch.cuda.Stream(device=device)
        self.h2d_stream = torch.cuda.Stream(device=device)
        self.registered: dict[int, torch.Tensor] = {}
        """``alloc_pinned``'s buffers by address, page-locked with cudaHostRegister."""

    def alloc_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Pinned (page-locked) memory lets the copy engines DMA asynchronously.
        t = torch.empty(numel, dtype=dtype)
        return t.pin_memory() if self.pin_memory else t

    def alloc_device(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        # torch's pinned allocator rounds every allocation up to a power of two (up to 2x a
        # storage-tier slot, which a host budget counts exactly): register plain memory
        # instead, exactly its size; torch's pinning when registration is refused
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if not self.pin_memory:
            return buffer
        try:
            torch.cuda.check_error(
                torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        except (RuntimeError, AttributeError):
            return buffer.pin_memory()
        self.registered[buffer.data_ptr()] = buffer
        return buffer

    def free_pinned(self, buffer: torch.Tensor) -> None:
        held = self.registered.pop(buffer.data_ptr(), None)
        # unregistered before torch may free (and reuse) the memory
        if held is not None:
            torch.cuda.cudart().cudaHostUnregister(held.data_ptr())

    def ready_token(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stream(self, kind: str) -> Any:
        return {"d2h": self.d2h_stream, "h2d": self.h2d_stream}.get(kind)

    def d2h(
        self, grads: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], ready: Any
    ) -> PendingStats:
        """Enqueue the copy, then the bucket's statistics, on the D2H stream and return at
        once: the copy goes first (the CPU step needs it), the ~9 norm kernels after it, and
        nothing here waits, so the lane keeps several buckets in flight
        (docs/engine.md, "Device spans on the device's clock")."""
        stream = self.d2h_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if ready is not None:
                # after the kernels that produced the gradients
                stream.wait_event(ready)
            for g, d in zip(grads, dst):
                # device-side cast
                src = g if g.dtype == d.dtype else g.to(d.dtype)
                d.copy_(src, non_blocking=True)
                # The gradient's memory belongs to the compute stream's allocator pool; keep it
                # alive until this stream is done with it (zero_grad may free it meanwhile).
                g.record_stream(stream)
            stats_dev = stats_tensor(grads, self.device)
            stats_host = torch.empty(2, dtype=torch.float32, pin_memory=self.pin_memory)
            stats_host.copy_(stats_dev, non_blocking=True)
            # waiters sleep instead of spinning
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
        return PendingStats(done, stats_host)

    def d2h_add(self, grads: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                add: Sequence[bool], ready: Any) -> None:
        """Each gradient crosses in its own dtype into a pinned staging buffer (the caching
        host allocator reuses them), then the host adds it into the fp32 sum: ZeRO-Offload's
        CPU-side accumulation. The lane waits for the copy (a blocking event, no spinning)."""
        stream = self.d2h_stream
        staged: list[torch.Tensor] = []
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            for g in grads:
                host = torch.empty(g.shape, dtype=g.dtype, pin_memory=self.pin_memory)
                host.copy_(g, non_blocking=True)
                # the caller may free the gradient at once
                g.record_stream(stream)
                staged.append(host)
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
        done.synchronize()
        with torch.no_grad():
            for h, d, a in zip(staged, dst, add):
                if a:
                    d.add_(h)
                else:
                    d.copy_(h)

    def h2d(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> Any:
        stream = self.h2d_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for s, d in zip(src, dst):
                if s.dtype == d.dtype:
                    d.copy_(s, non_blocking=True)
                else:
                    # Device-side cast: a mixed-dtype CPU->CUDA copy_ would convert on the
                    # host into unpinned memory, so stage the fp32 copy on the device first.
                    staged = torch.empty(s.shape, dtype=s.dtype, device=self.device)
                    staged.copy_(s, non_blocking=True)
                    d.copy_(staged)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def wait(self, token: Any) -> None:
        if token is not None:
            torch.cuda.current_stream(self.device).wait_event(token)

    def host_wait(self, token: Any) -> None:
        if token is not None:
            # the H2D stream's copy has read the pinned source
            token.synchronize()

    def device_stats(self, grads: Sequence[torch.Tensor]) -> GradStats:
        stats = stats_tensor(grads, self.device).cpu()
        return GradStats(float(stats[0]), int(stats[1]))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def make_device_ops(device: str, *, pin_memory: bool) -> DeviceOps:
    """Resolve OffloadConfig.device ("auto", "cpu", "cuda", "cuda:N") to its device ops."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return CpuDeviceOps()
    if not torch.cuda.is_available():
        raise ValueError(
            f"OffloadConfig.device={device!r} but CUDA is not available; use 'cpu' or 'auto'")
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return CudaDeviceOps(dev, pin_memory=pin_memory)
