"""The balancer behind `device_map="auto"`: a pure function from each block's predicted bytes and each
device's budget to the device of every block.

Rules, in order:
1. Contiguous runs: blocks keep their execution order and devices are used in the budgets' order,
   each for one run, so a forward changes device as few times as the split allows.
2. Fewest devices: the shortest prefix of the devices whose budgets can hold the job.
3. Balanced: among those, the cut that minimises the fullest device's share of its budget
   (predicted peak / budget), so a larger device takes more blocks.
4. Stack boundaries preferred: if cutting exactly where the encoder ends and the decoder starts
   leaves the fullest device at most SLACK (relative) fuller than the balanced optimum, and it
   still fits, that cut is taken: one fewer set of tensors crosses devices.
The main device (default: the first) also holds `main_bytes`: embeddings, head, final norms, logits.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import BigfitError

SLACK = 0.25
INFEASIBLE = (math.inf, math.inf)


def _solve(blocks: Sequence[int], caps: Sequence[int], fixed: Sequence[int], slow: Sequence[bool],
           per_device: int, cuts: Sequence[int]) -> tuple[tuple[float, float], list[int]]:
    """((bytes on slow devices, fullest device's share of its budget), start of each device's run):
    the lexicographically least over contiguous runs (maybe empty) that fit and span no position in
    `cuts`. Dynamic programming, O(devices x n^2); both criteria only grow as runs are added."""
    n, k = len(blocks), len(caps)
    prefix = [0]
    for b in blocks:
        prefix.append(prefix[-1] + b)

    def cost(j: int, p: int, i: int) -> tuple[float, float]:
        load = fixed[j] + prefix[i] - prefix[p] + (per_device if i > p else 0)
        if load > caps[j] or any(p < c < i for c in cuts):
            return INFEASIBLE
        return (prefix[i] - prefix[p] if slow[j] else 0, load / caps[j])

    best = [[INFEASIBLE] * (n + 1) for _ in range(k)]
    start = [[0] * (n + 1) for _ in range(k)]
    for i in range(n + 1):
        best[0][i] = cost(0, 0, i)
    for j in range(1, k):
        for i in range(n + 1):
            for p in range(i + 1):
                a, b = best[j - 1][p], cost(j, p, i)
                v = (a[0] + b[0], max(a[1], b[1]))
                if v < best[j][i]:
                    best[j][i], start[j][i] = v, p
    starts, i = [0] * k, n
    for j in range(k - 1, 0, -1):
        starts[j] = i = start[j][i]
    return best[k - 1][n], starts


def balance(blocks: Sequence[int], budgets: Sequence[tuple[str, int]], *, main_bytes: int = 0,
            main: str | None = None, per_device_bytes: int = 0, boundaries: Sequence[int] = ()) -> list[str]:
    """The device of each block (in execution order). `budgets`: (device, bytes) in order of
    preference; `boundaries`: block positions where a new stack starts; `per_device_bytes`: needed
    once on every device that holds a block (the recompute of one checkpointed block)."""
    if not budgets:
        raise BigfitError("device_map='auto' needs at least one device budget, like {'cuda:0': '24GB'}")
    devices = [d for d, _ in budgets]
    main = main or devices[0]
    if main not in devices:
        raise BigfitError(f"main device {main} has no budget; give one for it too (budgets: {', '.join(devices)})")
    for d, cap in budgets:
        if cap <= 0:
            raise BigfitError(f"device {d} has a budget of {cap} bytes; give each device a positive budget")
    caps = [cap for _, cap in budgets]
    fixed = [main_bytes if d == main else 0 for d in devices]
    # the host is the overflow when accelerators are listed: as little as possible goes there
    slow = [d.startswith("cpu") and any(x.startswith("cuda") for x in devices) for d in devices]
    first = devices.index(main) + 1  # the main device must be among those used
    for k in range(first, len(devices) + 1):
        args = (caps[:k], fixed[:k], slow[:k], per_device_bytes)
        score, starts = _solve(blocks, *args, ())
        if score != INFEASIBLE:
            break
    else:
        raise BigfitError(f"the model does not fit the budgets: it needs about {size(sum(blocks) + main_bytes)} "
                          f"(largest block {size(max(blocks, default=0))}, non-block parts on {main} "
                          f"{size(main_bytes)}) and the budgets give {size(sum(caps))} "
                          f"({', '.join(f'{d} {size(c)}' for d, c in budgets)}); add a device, raise a "
                          "budget, or shrink the job (batch, sequence length, activation checkpointing)")
    options = [_solve(blocks, *args, (b,)) for b in boundaries if 0 < b < len(blocks)]
    if options:
        (spill, share), cut_starts = min(options)
        if spill <= score[0] and share <= score[1] * (1 + SLACK):
            starts = cut_starts
    ends = starts[1:] + [len(blocks)]
    return [devices[j] for j in range(k) for _ in range(starts[j], ends[j])]


def size(n: float) -> str:
    """Bytes for people: GB (10^9) down to MB and bytes for small models."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e4 else f"{int(n)} B"


def loads(assignment: Sequence[str], blocks: Sequence[int], main: str, main_bytes: int = 0,
          per_device_bytes: int = 0) -> dict[str, int]:
    """Predicted bytes on each device for an assignment (what the plan shows beside each budget)."""
    out: dict[str, int] = {main: main_bytes}
    for dev, b in zip(assignment, blocks):
        out[dev] = out.get(dev, 0) + b
    for dev in set(assignment):
        out[dev] += per_device_bytes
    return out
