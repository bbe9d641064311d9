"""Draw the offload engine's host timeline (benchmarks/strategies.py's "trace" field) as a PNG: one
row per kind of host work, one bar per bucket, over the last two measured steps.

  python benchmarks/plot_trace.py results.jsonl "bigfit zero2-offload" timeline.png
"""
from __future__ import annotations

import json
import sys

ROWS = ("wait-host-step", "norm", "forward-waits", "wait-gradients", "cpu-adam", "upload")


def main(path: str, method: str, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = next(r for r in map(json.loads, open(path)) if r.get("method") == method and r.get("trace"))
    fig, ax = plt.subplots(figsize=(12, 3.2))
    for row, kind in enumerate(ROWS):
        spans = [(t0, max(t1 - t0, 1e-4)) for w, _, t0, t1 in rec["trace"] if w == kind]
        ax.broken_barh(spans, (row - 0.4, 0.8), color=f"C{row}")
    ax.set_yticks(range(len(ROWS)), ROWS)
    ax.set_xlabel("seconds from the start of the second-to-last step")
    ax.set_title(f"{method}: {rec['params_b']}B params, step {rec['step_s']} s (host side of the offload engine)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:4])
