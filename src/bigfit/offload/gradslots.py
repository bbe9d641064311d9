"""Where zero2-offload's gradients wait for the host step when host RAM is what runs out
(`offload_grads: device`): on the device, each bucket's reduced rows as backward left them (bf16
where kernels/cpu_adam.py's kernel reads them, else fp32), copied down through a few pinned slots just
ahead of the host optimizer's step of that bucket.

The default (`host`) copies every bucket down during backward into pinned buffers of its own: 2
bytes per parameter of host RAM (4 in fp32) on top of the optimizer's 12, in exchange for the copies
overlapping backward. Here the host holds `count` slots of the largest bucket instead, and the
device holds the gradients (2 or 4 bytes per parameter) until their copies land. The copies still overlap the host step:
PCIe moves a bucket's gradients about 4x faster than the host optimizer consumes them (RESULTS.md),
so only the first bucket's copy is waited for."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .buckets import Bucket


class GradientSlots:
    def __init__(self, io, numels: list[int], dtype: torch.dtype = torch.float32, count: int = 3):
        self.io = io
        self.slots = [io.host_zeros(max(numels), dtype) for _ in range(count)]
        self.pending: dict[int, torch.Tensor] = {}  # bucket index -> its slot's view, copy started

    def reset(self) -> None:
        """A new host step: copies of a failed one are forgotten."""
        self.pending = {}

    @torch.no_grad()
    def take(self, order: list[Bucket], i: int, landing: Callable[[Bucket], None]) -> torch.Tensor:
        """Bucket order[i]'s gradients in host RAM. Also starts the copies of the next buckets whose
        gradients are ready, into the slots the buckets before i have finished with (bucket j uses
        slot j mod count, and every bucket before i has been stepped). `landing(b)` waits for b's
        gradients to be reduced (hoststep.py: it ends the host step of an abandoned step instead)."""
        for j in range(i, min(i + len(self.slots), len(order))):
            b = order[j]
            if b.index in self.pending:
                continue
            if j > i and not b.state["reduced"].is_set():
                break  # not reduced yet (eager mode steps during backward): copied when its turn comes
            landing(b)
            b.state["reduced"].clear()
            self.pending[b.index] = self.io.fetch(b.state, self.slots[j % len(self.slots)])
        return self.pending.pop(order[i].index)
