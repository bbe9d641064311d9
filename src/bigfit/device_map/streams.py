"""The CUDA side of a cross-device copy (moves.py decides when one is made; this file how).

Each GPU computes on its current stream (the caller's, normally the default one) and has one copy
stream beside it. A copy waits for exactly the work queued before it on the source device (the
event of this micro-batch's activation), never for work queued later, and the consumer's compute
stream waits for the copy, never the host:

- GPU -> GPU. torch's copy puts a two-way barrier between the *current* streams of both devices
  (the source's stream waits for everything queued on the destination's, and the destination's
  for the copy). Run on the compute streams, that makes A's next micro-batch wait for B's current
  one, and the two devices take turns. So the copy runs with both copy streams current: the
  barrier then orders copies among themselves only.
- GPU -> host: into pinned memory (torch pins a non-blocking copy to the host), with an event that
  whoever reads the result waits for (`Landing`, moves.settle).
- host -> GPU: staged through pinned memory first (from pageable memory the driver may wait for
  the stream, that is for the GPU to drain), copied on the destination's copy stream.

Memory: a source read on a copy stream is `record_stream`ed there, and a destination allocated on
a copy stream is recorded on the compute stream that uses it, so the caching allocator never
hands out memory that a queued copy or kernel still touches. Pinned buffers are recorded by torch.
"""
from __future__ import annotations

import threading

import torch

_copy_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()  # forward workers and autograd's device threads all copy


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    with _lock:
        stream = _copy_streams.get(device.index)
        if stream is None:
            stream = _copy_streams[device.index] = torch.cuda.Stream(device=device)
    return stream


def gpu_to_gpu(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    src_side, dst_side = copy_stream(t.device), copy_stream(dev)
    src_side.wait_stream(torch.cuda.current_stream(t.device))  # what produced t, and nothing later
    with torch.cuda.stream(src_side), torch.cuda.stream(dst_side):
        out = t.to(dev, non_blocking=True)  # allocated for dst_side; copied on src_side
    consumer = torch.cuda.current_stream(dev)
    consumer.wait_stream(dst_side)
    t.record_stream(src_side)
    out.record_stream(consumer)
    return out


def gpu_to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """A pinned copy and the event that says it has landed."""
    t = t.contiguous()  # else torch copies through a pageable temporary, which waits for the GPU
    side = copy_stream(t.device)
    side.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(side):
        out = t.to("cpu", non_blocking=True)
    event = torch.cuda.Event()
    event.record(side)
    t.record_stream(side)
    return out, event


def host_to_gpu(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    t = t.contiguous()  # a strided copy would go through a pageable temporary after all
    staged = t if t.is_pinned() else t.pin_memory()
    side = copy_stream(dev)
    with torch.cuda.stream(side):
        out = staged.to(dev, non_blocking=True)
    consumer = torch.cuda.current_stream(dev)
    consumer.wait_stream(side)
    out.record_stream(consumer)
    return out


class Landing:
    """A GPU -> host copy made in backward, which a CPU node must wait for (moves.py): autograd
    runs the copy on the GPU's device thread and the CPU consumer on the calling thread, so the
    device thread goes on launching kernels and only the CPU waits, for this one copy."""

    def __init__(self):
        self.event = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
