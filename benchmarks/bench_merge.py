"""One `bigfit bench` table from several runs on the same workload, with the peers' rows beside them.

    python benchmarks/bench_merge.py --out DIR BENCH.json [BENCH.json ...] [--peers PEERS.json ...]
        [--auto-pick STRATEGY]

A GPU call's time limit often splits a bench into several runs (each `--strategies` a few rows), and
benchmarks/peers_t5.py measures plain PyTorch and DeepSpeed on the same workload in the same columns.
This writes DIR/bench.md, bench.csv, bench.json and bench.png through bigfit.bench.report, in the
order given: a later run's row of a method replaces an earlier one's unless the later did not run to
the end. Peers' rows are named "<method> (peer)" and have no predictions; their tokens/s and TFLOP/s
are the bench's per sample (trained target tokens, not padding) at their step time. Each run's own
`--strategy auto` pick covers only its run's strategies; `--auto-pick` names the pick among all of
them on that machine (benchmarks/results/2026-12-06-table/auto_pick.py asks it there), which the
recommendation then weighs against the fastest measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from bigfit.bench.report import recommendation, write  # noqa: E402

PEER_NAMES = {"torch": "PyTorch bf16 autocast", "ds-z2": "DeepSpeed ZeRO-2", "ds-z2-offload": "DeepSpeed ZeRO-2 offload"}
PEER_KEYS = ("micro", "train_s", "eval_s", "bleu", "step_s", "tokens_per_s", "peak_gpu_gb", "host_rss_gb")


def peer_row(row: dict, per_sample: tuple[float, float] | None) -> dict:
    """A peers_t5.py row in the bench's columns. Its tokens/s counts padded targets; the bench counts
    the target tokens trained: `per_sample` (the bench's tokens a sample, its TFLOP a token) rates the
    peer's step on the same samples."""
    out = {k: row.get(k) for k in PEER_KEYS}
    if per_sample and row.get("step_s"):
        out["tokens_per_s"] = round(row["micro"] * per_sample[0] / row["step_s"], 1)
        out["tflops"] = round(out["tokens_per_s"] * per_sample[1], 2)
    failed = row.get("error")
    out.update(method=f"{PEER_NAMES.get(row['method'], row['method'])} (peer)", strategy=row["method"],
               precision="bf16", batch=row.get("micro"), status="error" if failed else "ok",
               reason=failed or row.get("note"))
    return out


def merged(benches: list[dict], peers: list[list[dict]]) -> list[dict]:
    """The benches' rows, one a method (a later one replaces an earlier unless it did not run to the
    end), then the peers' in the bench's columns."""
    rows: dict[str, dict] = {}
    for bench in benches:
        for r in bench["rows"]:
            if r["method"] not in rows or r["status"] == "ok" or rows[r["method"]]["status"] != "ok":
                rows[r["method"]] = r
    ran = [r for r in rows.values() if r.get("tokens_per_s") and r.get("tflops") and r["status"] == "ok"]
    per_sample = (statistics.median(r["tokens_per_s"] * r["step_s"] / r["batch"] for r in ran),
                  statistics.median(r["tflops"] / r["tokens_per_s"] for r in ran)) if ran else None
    return list(rows.values()) + [peer_row(r, per_sample) for group in peers for r in group]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("benches", nargs="+", type=Path, help="bench.json files, oldest first")
    ap.add_argument("--peers", nargs="*", type=Path, default=[], help="peers_t5.py --json files")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--auto-pick", help="what --strategy auto picks among every run's strategies on that machine")
    a = ap.parse_args()
    benches = [json.loads(p.read_text()) for p in a.benches]
    rows = merged(benches, [json.loads(p.read_text()) for p in a.peers])
    a.out.mkdir(parents=True, exist_ok=True)
    first = benches[0]
    meta = {k: first.get(k) for k in ("model", "data", "train_samples", "eval_samples", "num_beams")}
    meta["sources"] = ", ".join(str(p) for p in [*a.benches, *a.peers])
    meta["each_run_auto_pick"] = "among its own strategies: " + "; ".join(
        f"{b.get('started')} {b.get('auto_pick')}" for b in benches)
    if a.auto_pick:
        meta["auto_pick"] = f"{a.auto_pick} (among every run's strategies, asked on a machine of the same kind)"
    meta["recommendation"] = recommendation(rows, a.auto_pick)
    for path in write(a.out, rows, meta):
        print(path)


if __name__ == "__main__":
    main()
