"""Where `bigfit train --strategy zero3` spends a step that strategies.py's bare loop over the same engine
does not: torch's profiler over 3 steps (after 6) in each driver; per step the host's wall time from one
train_step to the next, the GPU's kernel time, and the host operators by self time.
python diag.py engine|command OUT SIZE SEQ   (run from the repository root, PYTHONPATH=src)"""
import json, os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
mode, out, size, seq = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import torch
from torch.profiler import ProfilerActivity, profile
import bigfit.train.step as S

FIRST, N = 6, 3
calls, stamps, state = [0], [], {}
orig = S.train_step


def train_step(*a, **k):
    calls[0] += 1
    stamps.append(time.perf_counter())
    if calls[0] == FIRST + 1:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        state["prof"] = profile(activities=acts)
        state["prof"].__enter__()
    r = orig(*a, **k)
    if calls[0] == FIRST + N:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        state["prof"].__exit__(None, None, None)
        dump()
    return r


def dump():
    ev = state["prof"].key_averages()
    cuda = sum(getattr(e, "self_device_time_total", 0) or 0 for e in ev) / 1e3 / N
    cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:25]
    periods = [round(b - a, 4) for a, b in zip(stamps[FIRST:], stamps[FIRST + 1:])]
    res = {"mode": mode, "step_periods_s": periods, "gpu_kernel_ms_per_step": round(cuda, 2),
           "host_self_ms_per_step": {e.key: round(e.self_cpu_time_total / 1e3 / N, 2) for e in cpu},
           "host_calls_per_step": {e.key: e.count // N for e in cpu}}
    with open(os.path.join(out, f"diag-{mode}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("DIAG", json.dumps({k: res[k] for k in ("step_periods_s", "gpu_kernel_ms_per_step")}), flush=True)


S.train_step = train_step
import bigfit.train.loop as L
L.train_step = train_step
steps = FIRST + N + 1
if mode == "engine":
    import strategies
    strategies.train_step = train_step
    r = strategies.run_one("zero3", size, 4, seq, steps - 2, 2, 1)
    r.pop("trace", None)
    print("RESULT", json.dumps(r))
else:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29513")
    from pathlib import Path
    from bigfit.cli import main
    import command_vs_engine as C
    root = Path("/tmp/diag"); root.mkdir(exist_ok=True)
    model = C.write_inputs(root, size, seq, False)
    main(["train", "--model", str(model), "--data", str(root / "data.txt"), "--strategy", "zero3", "--nproc", "1",
          "--precision", "bf16", "--batch-size", "4", "--max-source-len", str(seq), "--max-steps", str(steps),
          "--eval-every", "0", "--eval-samples", "0", "--save-every", "0", "--no-checkpoints", "--lr", "1e-4",
          "--warmup-steps", "0", "--output-dir", str(root / "run")])
