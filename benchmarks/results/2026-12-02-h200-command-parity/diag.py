"""Where bigfit train's zero2-offload step loses time against the bare-loop harness: phase stamps of
every step (train_step's enter, run_batch done, update done, return), the engine's timeline of two
steps, in both drivers. Run from a copy of the tree at gpu-src/: python diag.py engine|command OUT SIZE SEQ STEPS"""
import json, os, sys, time, atexit
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "src"), os.path.join(HERE, "benchmarks")]
mode, out, size, seq, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
import torch
import bigfit.train.step as S
from bigfit.strategies.offloading import OffloadApplied
rec, calls = [], [0]
cur = {}
def stamp(k): cur[k] = time.perf_counter()
orig_run, orig_upd = OffloadApplied.run_batch, OffloadApplied.update
def run_batch(self, *a, **k):
    r = orig_run(self, *a, **k); stamp("run_done"); return r
def update(self, *a, **k):
    stamp("update_enter"); r = orig_upd(self, *a, **k); stamp("update_done"); return r
OffloadApplied.run_batch, OffloadApplied.update = run_batch, update
orig_step = S.train_step
def train_step(engine, *a, **k):
    calls[0] += 1
    if calls[0] == steps - 1 and getattr(engine, "engine", None) is not None:
        engine.engine.trace, cur["trace_from"] = [], time.perf_counter()
    cur.clear() if "trace_from" not in cur else None
    stamp("enter"); r = orig_step(engine, *a, **k); stamp("return")
    rec.append(dict(cur))
    if getattr(engine, "engine", None) is not None and engine.engine.trace is not None and calls[0] == steps:
        t0 = cur.get("trace_from", 0)
        rec.append({"trace": [(w, b, round(a - t0, 4), round(c - t0, 4)) for w, b, a, c in engine.engine.trace]})
    return r
S.train_step = train_step
import bigfit.train.loop as L
L.train_step = train_step
def dump():
    with open(os.path.join(out, f"diag-{mode}.json"), "w") as f:
        json.dump(rec, f)
atexit.register(dump)
if mode == "engine":
    import strategies
    strategies.train_step = train_step
    r = strategies.run_one("zero2-offload", size, 4, seq, steps - 2, 2, 1)
    r.pop("trace", None); print("RESULT", json.dumps(r))
else:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    from bigfit.cli import main
    import command_vs_engine as C
    root = os.path.join("/tmp", "diag"); os.makedirs(root, exist_ok=True)
    model = C.write_inputs(__import__("pathlib").Path(root), size, seq, False)
    main(["train", "--model", str(model), "--data", os.path.join(root, "data.txt"), "--strategy", "zero2-offload",
          "--precision", "bf16", "--batch-size", "4", "--max-source-len", str(seq), "--max-steps", str(steps),
          "--eval-every", "0", "--eval-samples", "0", "--save-every", "0", "--no-consolidate", "--lr", "1e-4",
          "--warmup-steps", "0", "--output-dir", os.path.join(root, "run")])
