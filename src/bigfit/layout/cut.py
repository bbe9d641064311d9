"""Where the pipeline is cut: pure functions over block sizes, no model and no processes.

The blocks of every stack, in forward order (T5: encoder blocks, then decoder blocks), form one
list; each stage takes a contiguous run of it. Runs are balanced by parameter count (a block's
parameters are a fair proxy for its compute: T5 decoder blocks, with cross-attention, weigh more
than encoder blocks). Embeddings and the head are not counted; they go with the first and last
blocks of their stack.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BigfitError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class PipelineLayout:
    """Stages over ranks. Pure pipeline: every rank is one pipeline position, no data parallelism.
    Interleaved: rank r holds stages r, r + world, r + 2 * world, ... (the loop order torch's
    ScheduleInterleaved1F1B runs)."""

    world: int  # processes, all of them pipeline positions
    stages_per_rank: int  # 1, or more for the interleaved schedule (virtual stages)
    schedule: str  # one of SCHEDULES
    chunks: int  # pipeline micro-batches per forward/backward of one micro-batch

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise BigfitError(f"--pipeline-schedule {self.schedule!r} is not valid; choose one of: "
                              + ", ".join(SCHEDULES))
        if self.schedule == "interleaved" and self.stages_per_rank < 2:
            raise BigfitError(f"--pipeline-schedule interleaved needs --stages-per-rank 2 or more, got "
                              f"{self.stages_per_rank}")
        if self.schedule != "interleaved" and self.stages_per_rank != 1:
            raise BigfitError(f"--stages-per-rank {self.stages_per_rank} needs --pipeline-schedule interleaved "
                              f"(gpipe and 1f1b run one stage per rank), not {self.schedule}")
        if self.schedule == "1f1b" and self.chunks < self.stages:
            raise BigfitError(f"--pipeline-schedule 1f1b needs --chunks >= the {self.stages} stages, got "
                              f"{self.chunks}; use --chunks {self.stages} or more (or gpipe)")
        if self.schedule == "interleaved" and self.chunks % self.world:
            raise BigfitError(f"--pipeline-schedule interleaved needs --chunks a multiple of the {self.world} "
                              f"processes, got {self.chunks}")

    @property
    def stages(self) -> int:
        return self.world * self.stages_per_rank

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.stages, self.world))

    def rank_of(self, stage: int) -> int:
        return stage % self.world


def balance(costs: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut `costs` (one per block) into `parts` contiguous, non-empty runs [start, stop): the largest
    run as small as possible (the slowest stage sets the pace), and among such cuts the most even
    (least sum of squares), so that one heavy block does not leave the other runs lopsided. Exact
    dynamic programs, O(n^2 * parts)."""
    n = len(costs)
    if parts > n:
        raise ValueError(f"{parts} parts of {n} blocks")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    run = lambda j, i: prefix[i] - prefix[j]  # noqa: E731
    worst = _best_cuts(n, parts, lambda acc, j, i: max(acc, run(j, i)))[0]
    _, cuts = _best_cuts(n, parts, lambda acc, j, i: acc + run(j, i) ** 2 if run(j, i) <= worst else float("inf"))
    return cuts


def _best_cuts(n: int, parts: int, add) -> tuple[float, list[tuple[int, int]]]:
    """The cut of n blocks into `parts` runs minimising a cost built run by run: add(cost so far,
    start, stop). best[k][i]: the least cost of the first i blocks in k runs."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut_at = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = add(best[k - 1][j], j, i)
                if cost < best[k][i]:
                    best[k][i], cut_at[k][i] = cost, j
    runs, i = [], n
    for k in range(parts, 0, -1):
        j = cut_at[k][i]
        runs.append((j, i))
        i = j
    return best[parts][n], runs[::-1]


def check_depth(n_blocks: int, layout: PipelineLayout, stacks: str) -> None:
    """Every stage needs at least one block."""
    if n_blocks < layout.stages:
        per = (f" ({layout.world} processes x {layout.stages_per_rank} stages per rank)" if layout.stages_per_rank > 1
               else " (one per process)")
        raise BigfitError(f"--strategy pipeline cuts the model into {layout.stages} stages{per}, but it has only "
                          f"{n_blocks} blocks ({stacks}); use at most {n_blocks} stages (fewer processes or "
                          "--stages-per-rank), or device_map / zero3 for a model this shallow")
