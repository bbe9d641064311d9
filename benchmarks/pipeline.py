"""The pipeline measurement: the bubble of each schedule against (p-1)/(m+p-1), and pipeline
throughput against zero3 on the same model and GPUs.

  python benchmarks/pipeline.py --gpus 2 --size 3b --seq 2048 --out $OUT/pipeline.jsonl
Each (schedule, m) runs `strategies.py one pipeline+SCHEDULE --chunks m --mbs m` under torchrun: a
step of m micro-batches of one sequence each over p = --gpus stages. The time of one micro-batch
through the slowest stage, t, is the slope of step time against m over the m measured; the measured
bubble is 1 - m t / T(m), the share of the step in which the slowest stage waits. Interleaved runs
two stages per GPU, so its predicted bubble is (p-1)/(2m+p-1). zero3 runs the same global batch
(m sequences a step, m/p per GPU) on the same GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scaling import HERE, _torchrun  # noqa: E402

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # schedule -> stages per GPU


def predicted(schedule: str, p: int, m: int) -> float:
    return (p - 1) / (SCHEDULES[schedule] * m + p - 1)


def slope(rows: list[dict]) -> float:
    """Least-squares seconds per micro-batch of step time against m."""
    xs, ys = [r["m"] for r in rows], [r["step_s"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--size", default="3b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ms", default=None, help="micro-batches per step to try (default p, 2p, 4p)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--out")
    a = ap.parse_args()
    p = a.gpus
    ms = [int(m) for m in a.ms.split(",")] if a.ms else [p, 2 * p, 4 * p]
    common = ["--size", a.size, "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", "1"]
    for schedule in a.schedules.split(","):
        runs = []
        for m in ms:
            script = [os.path.join(HERE, "strategies.py"), "one", f"pipeline+{schedule}", "--chunks", str(m),
                      "--mbs", str(m), *common]
            runs.append({"method": f"pipeline {schedule}", "gpus": p, "m": m, **_torchrun(p, script, a.timeout)})
        done = [r for r in runs if "step_s" in r]
        t = slope(done) if len(done) >= 2 else None
        for r in runs:
            if t and t > 0 and "step_s" in r:  # a flat or falling slope: too noisy to split
                r.update(bubble=round(1 - r["m"] * t / r["step_s"], 3), predicted=round(predicted(schedule, p, r["m"]), 3))
            _emit(r, a.out)
    for m in ms:  # the same global batch, data parallel: m / p sequences per GPU
        if m % p == 0:
            script = [os.path.join(HERE, "strategies.py"), "one", "zero3", "--mbs", str(m // p), *common]
            r = {"method": "zero3", "gpus": p, "m": m, **_torchrun(p, script, a.timeout)}
            if "tok_s" in r:
                r["tok_s_total"] = r["tok_s"] * p
            _emit(r, a.out)


def _emit(r: dict, out: str | None) -> None:
    r = {k: v for k, v in r.items() if k != "trace"}
    if "tok_s" in r and "tok_s_total" not in r:
        r["tok_s_total"] = r["tok_s"]  # a pipeline's rank 0 counts the whole batch
    print(json.dumps(r), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
