"""Pure searches over micro-batch sizes for `--micro-batch-size auto` / `--batch-size auto`: the
largest size the planner predicts to fit, and the probe's search for the largest that runs.

Both rest on memory growing with the micro-batch: what fits at m fits below m. The probe's search
is a value (`ProbeSearch`: the sizes allowed and every outcome so far) from which the next size
follows, so the launcher and the probe workers, which share it through a file (training/probefile.py),
always agree on which size a worker set was trying when it ended."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

MAX_MICRO = 4096  # the largest micro-batch `auto` considers: a step of more is long enough to hide any overhead
# The probe's first step away from the prediction, up where it ran, down where it failed, as a share of
# it; later steps double, so even a prediction far off costs only about log2 probes. Predictions are
# near: the data-parallel rows of `bigfit bench` on an H200 (T5-large, 2026-12-05) within 1-2% of the
# probe's answer. A small first step leaves a small gap to bisect, and bisecting from 0 after a
# prediction that failed cost several failed sizes on the way, each a new worker set on several ranks
# (and, until 2026-12-05, for the offload engine on one).
FIRST_STEP = 0.1


def divisors(n: int, low: int = 1) -> list[int]:
    """The micro-batches that split a per-rank share of n samples into whole accumulation steps."""
    return [m for m in range(max(1, low), n + 1) if n % m == 0]


def largest_true(holds: Callable[[int], bool], values: list[int]) -> int | None:
    """The largest of the ascending `values` for which `holds`, when it holds up to some value and
    not after (None if not even for the first): galloping from the smallest, then bisecting, so
    about 2 log2(answer) calls, most of them on small sizes, which the planner traces fastest."""
    if not values or not holds(values[0]):
        return None
    lo, hi, step = 0, len(values), 1  # values[lo] holds; from hi on nothing is known to (end: treated as failing)
    while lo + step < hi:
        if not holds(values[lo + step]):
            hi = lo + step
            break
        lo, step = lo + step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(values[mid]):
            lo = mid
        else:
            hi = mid
    return values[lo]


@dataclass
class Prediction:
    """The planner's answer for `auto`: the sizes that may run and the largest predicted to fit."""

    size: int  # the largest micro-batch predicted to fit
    need: int  # its predicted bytes on the fullest GPU
    budget: int  # what the plan hands out per GPU (the smallest GPU less the reserve)
    sizes: list[int]  # the micro-batches a run may take, ascending (divisors of a fixed per-rank share)
    step_s: float = 0.0  # its predicted step time


@dataclass
class ProbeSearch:
    """Probe the prediction first; step away from it (up while sizes run, down while they fail) by
    FIRST_STEP of it, doubling the step each probe, until the answer changes; then bisect between
    the largest that ran and the smallest that failed, until no allowed size lies between."""

    start: int  # the first size probed: the prediction
    sizes: list[int]  # the sizes that may be probed, ascending
    # [size, ran, peak bytes or None], in probe order. Not ran but with a peak: the size ran, but the
    # allocator flushed its cache in its step (too full to run at speed, training/probe.py): as a failure here
    outcomes: list[list] = field(default_factory=list)
    worker_sets: int = 0  # probe worker sets started; each builds the model once

    def within(self, limit: int) -> "ProbeSearch":
        """Only sizes up to `limit` (the training samples each data-parallel rank has to fill one)."""
        sizes = [s for s in self.sizes if s <= limit] or self.sizes[:1]
        start = max([s for s in sizes if s <= self.start], default=sizes[0])
        return ProbeSearch(start, sizes, list(self.outcomes), self.worker_sets)

    def ran(self) -> list[int]:
        """The sizes that ran at speed."""
        return [s for s, ok, _ in self.outcomes if ok]

    def failed(self) -> list[int]:
        return [s for s, ok, _ in self.outcomes if not ok]

    def best(self) -> int | None:
        """The largest size that ran at speed; where every size that ran needed the allocator's cache
        flushed, the smallest of those (a slow run rather than none); None while none has run."""
        full = [s for s, ok, peak in self.outcomes if not ok and peak]
        return max(self.ran(), default=min(full, default=None))

    def peak(self, size: int) -> int | None:
        return next((p for s, _, p in self.outcomes if s == size and p), None)

    def next(self) -> int | None:
        """The size to probe next; None when the search is over."""
        if not self.outcomes:
            return self.start
        lo, failed = max(self.ran(), default=None), self.failed()
        step = max(1, math.ceil(self.start * FIRST_STEP)) * 2 ** (len(self.outcomes) - 1)
        if not failed:  # everything so far ran: step up
            bigger = [s for s in self.sizes if s > lo]
            return next((s for s in bigger if s >= lo + step), bigger[-1]) if bigger else None
        if lo is None:  # nothing ran yet: step down
            smaller = [s for s in self.sizes if s < min(failed)]
            return next((s for s in reversed(smaller) if s <= min(failed) - step), smaller[0]) if smaller else None
        between = [s for s in self.sizes if lo < s < min(failed)]
        return between[len(between) // 2] if between else None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ProbeSearch":
        return cls(d["start"], list(d["sizes"]), [list(o) for o in d["outcomes"]], d["worker_sets"])


def outcome_text(outcomes: list[list]) -> str:
    """'9 ok, 14 OOM, 12 ok, 13 full' (full: it ran, but only by flushing the allocator's cache)"""
    return ", ".join(f"{s} {'ok' if ok else 'full' if peak else 'OOM'}" for s, ok, peak in outcomes)
