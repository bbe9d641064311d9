"""`bigfit plan --max-seq-len`: for each row of the plan (the named strategies and the composed layouts),
the longest sequence a sample predicted to fit at the job's micro-batch (1 unless given), with the way
of keeping activations it needs (keeping.py, under --activations auto) and the row there.

The planner's memory model at each length, without a trace at each: every count the trace keeps is a
polynomial of degree two at most in the sample's length (saved tensors, block inputs, logits, traffic
and tokens grow with it; attention's FLOPs and any S x S tensor the trace saves, such as the explicit
causal mask transformers builds under fake tensors, with its square; parameters and operators not at
all), so three traces at short lengths (TRACED) give every other length exactly: a profile at the
length itself says the same (tests/test_planning_activations.py). Each row's bytes grow with the
length, so a doubling search then a bisection finds its longest: about 2 log2(length) ratings, pure
arithmetic. The GPUs are rated with CACHE_SLACK of their budget left, as micro-batch auto rates them."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from . import layouts as composed_layouts
from .layouts import LayoutCandidate, rate_layout
from .estimate import CACHE_SLACK
from .rows import Candidate, roomy, with_slack
from .search import ALL, WHOLE, plan, traces

TRACED = (512, 1024, 1536)  # the lengths traced, evenly spaced: the fit of degree two through them
LONGEST = 1 << 24  # the longest length searched (16M tokens)


@dataclass
class Longest:
    """One row's longest sequence: its name, the tokens a sample (None: not even the shortest fits), the
    row rated there (its bytes, time and way of keeping activations), and what stops it one step longer."""
    name: str
    tokens: int | None
    row: Candidate | None
    beyond: str

    def to_json(self) -> dict:
        return {"name": self.name, "max_seq_len": self.tokens, "beyond": self.beyond,
                "row": self.row.to_json() if self.row else None}


def longest(model_config, hw, job, layouts: dict | None = None) -> tuple[list[Longest], list[Longest], int]:
    """(the named rows' longest sequences, the composed plans', the micro-batch rated) of `job` on `hw`
    (`layouts`: the composed plans' fixed degrees, None for none). A sample's source length grows; an
    encoder-decoder's target length stays the job's."""
    micro = job.micro_batch or 1
    base = replace(job, micro_batch=micro, batch_size=micro * hw.world_size)
    shorts = [traces(model_config, hw, replace(base, seq_len=n), ALL, layouts) for n in TRACED]
    fitted: dict[int, tuple] = {}

    def at(n: int) -> tuple:  # the three profiles (data-parallel, autocast, per device) at n tokens
        if n not in fitted:
            fitted[n] = tuple(_at_length([s[i] for s in shorts], n) for i in range(3))
        return fitted[n]

    # device maps and pipelines fill each device's budget less the allocator's share; the data-parallel
    # and composed rows are rated on the whole GPUs and must leave that share (rows.roomy), which
    # --activations auto's choice leaves itself
    room = with_slack(hw)
    holds = lambda row: row.fits and roomy(row.estimate, hw)  # noqa: E731
    named = [_search(name, lambda n, s=name: _named_row(s, at(n), room if s in WHOLE else hw, replace(base, seq_len=n)),
                     1, (lambda row: row.fits) if name in WHOLE else holds)
             for name in ALL if name != "single" or hw.world_size == 1]
    if layouts is None:
        return [r for r in named if r.name], [], micro
    prof = at(TRACED[0])[0]
    rated = plan(prof, hw, replace(base, seq_len=TRACED[0]), (), layouts=layouts).layouts or []
    mine = [_search(c.estimate.name, lambda n, c=c: _layout_row(c, at(n)[0], hw, base, n), 2 * c.plan.cp, holds)
            for c in rated]
    return [r for r in named if r.name], sorted(mine, key=lambda r: -(r.tokens or 0)), micro


def _named_row(name: str, profs: tuple, hw, job) -> Candidate | None:
    prof, autocast, split = profs
    out = plan(prof, hw, job, (name,), autocast, split).candidates
    return out[0] if out else None


def _layout_row(c: LayoutCandidate, prof, hw, base, n: int) -> Candidate | None:
    """A composed plan at n tokens a sample: its data-parallel ranks each a micro-batch (no accumulation)."""
    p = c.plan
    job = replace(base, seq_len=n, batch_size=base.micro_batch * p.dp)
    try:
        pipe = composed_layouts._pipe(p.pp, prof, job, base.micro_batch) if p.pp > 1 else None
    except composed_layouts._Reject:
        return None
    return rate_layout(p, c.strategy, prof, hw, job, base.micro_batch, pipe)


def _search(name: str, rate, step: int, holds) -> Longest:
    """The longest multiple of `step` tokens at which `rate(n)` (a Candidate) `holds`, doubling from
    TRACED[0] (or from `step` where that does not hold), then bisecting."""
    rows: dict[int, Candidate | None] = {}

    def fits(n: int) -> bool:
        if n not in rows:
            rows[n] = rate(n)
        return rows[n] is not None and holds(rows[n])

    first = _multiple(TRACED[0], step)
    lo = first if fits(first) else step
    if not fits(lo):
        row = rows[lo]
        return Longest(name if row else "", None, row, _why(row) if row else "not rated")
    hi = lo * 2
    while hi <= LONGEST and fits(_multiple(hi, step)):
        lo, hi = _multiple(hi, step), hi * 2
    hi = min(_multiple(hi, step), _multiple(LONGEST, step) + step)
    while hi - lo > step:
        mid = _multiple((lo + hi) // 2, step)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    over = rows.get(hi)
    beyond = (f"at {hi:,} tokens: {_why(over)}" if over is not None
              else f"{LONGEST:,} tokens is the longest searched" if hi > LONGEST else "")
    return Longest(name, lo, rows[lo], beyond)


def _why(row: Candidate) -> str:
    """Why `row` does not hold its length: what does not fit, or the allocator's share it would take."""
    if not row.fits:
        return row.why_not
    return (f"it needs {row.estimate.per_gpu['total'] / 1e9:.1f} GB per GPU, within the {CACHE_SLACK:.0%} of its "
            "budget left to the allocator's cache (GPU memory)")


def _multiple(n: int, step: int) -> int:
    return max(step, n // step * step)


def _at_length(profs: list, n: int):
    """The profile at n tokens a sample from those at TRACED (None where the rows need none): each count
    through the three by the polynomial of degree two they lie on (Newton's form; equal ones as they are)."""
    if profs[0] is None:
        return None
    a, b, c = profs
    d = TRACED[1] - TRACED[0]
    x, y = (n - TRACED[0]) / d, (n - TRACED[1]) / d

    def fit(u, v, w):
        if isinstance(u, (list, tuple)) and len(u) == len(v) == len(w):
            return type(u)(fit(*t) for t in zip(u, v, w))
        if isinstance(u, (int, float)) and not isinstance(u, bool) and not u == v == w:
            return u + (v - u) * x + (w - 2 * v + u) * x * y / 2
        return u

    return replace(a, **{f.name: fit(getattr(a, f.name), getattr(b, f.name), getattr(c, f.name)) for f in fields(a)})
