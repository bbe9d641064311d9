"""The seed discussion's table for the peers: plain PyTorch and DeepSpeed ZeRO-2 with and without CPU
offload on the workload `bigfit bench` measures (a T5 config, translation pairs, 128/128 tokens), in
the bench's columns: the largest micro-batch that runs, the time to train N samples at it, the time
of one beam-search evaluation of M samples and its BLEU, peak GPU memory, host RSS, tokens/s.

    python benchmarks/peers_t5.py --model T5_DIR --data pairs.jsonl [--methods torch,ds-z2,ds-z2-offload]
        [--train-samples 1024] [--eval-samples 32] [--num-beams 4] [--json OUT.json]

../shared/bench/peers.py does the same for Llama shapes at a fixed batch; this one follows the
seed's DeepSpeed config (ZeRO-2, bucket sizes 2e8, overlap_comm, contiguous gradients, the
optimizer on the CPU for offload; bf16, as bigfit's rows, since fp16 overflows on T5) and finds each
method's largest batch itself, as bigfit's probe does: sizes doubled from --start until one runs out
of memory (or grown by --step), then bisected down to --resolution: plain PyTorch in one process,
freeing what a failed size held; DeepSpeed upward in one process until an out-of-memory error ends
it (its engine does not recover), the next process starting from what is known. The pairs are tokenized
with bigfit's tokenizer for the model (byte-level for a config-only directory), so both see the same
tokens. DeepSpeed must be importable (../shared/bench/peer_wheels.sh); `--device cpu` tries the plain
PyTorch path on a machine without a GPU (tiny models; PEERS_OOM_ABOVE=N fails sizes above N).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
# the settings a size's own process takes over from the driver
SHARED = ("model", "data", "method", "train_samples", "eval_samples", "eval_batch", "num_beams", "max_new_tokens",
          "max_source_len", "max_target_len", "lr", "device", "timed_steps", "start", "step", "resolution",
          "max_batch")


def _pairs(args, tok):
    with open(args.data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    enc = lambda texts, n: tok(texts, max_length=n, truncation=True, padding="max_length", return_tensors="pt")  # noqa: E731
    src, tgt = [r["source"] for r in rows], [r["target"] for r in rows]
    return enc(src, args.max_source_len), enc(tgt, args.max_target_len), src, tgt


def _engine(method: str, build, batch: int, lr: float):
    """(forward-backward-step function, the module generate() runs on); `build()` makes the model."""
    import torch

    model = build()

    if method.startswith("torch"):
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=next(model.parameters()).is_cuda)

        def step(inputs):
            with torch.autocast(inputs["input_ids"].device.type, dtype=torch.bfloat16):
                loss = model(**inputs).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step, model
    import deepspeed

    zero = {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
            "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True}
    if method == "ds-z2-offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": zero, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}}
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as e:  # FusedAdam is built on first use, with nvcc: torch's AdamW where it cannot be
        if method != "ds-z2":
            raise
        print(f"NOTE FusedAdam failed ({type(e).__name__}: {str(e)[:200]}); torch's AdamW instead", flush=True)
        cfg["optimizer"]["params"]["torch_adam"] = True
        model = build()  # the failed engine left its forward hooks on the first (they fail without it)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(inputs):
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        return loss
    return step, engine.module


class Job:
    """One method's model, engine and tokenized pairs in this process."""

    def __init__(self, args, batch: int):
        import torch

        from bigfit.data.tokenize import held_out
        from bigfit.models.source import build_model, load_config, load_tokenizer, locate

        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29513"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                     ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
        self.args, self.device = args, torch.device(args.device)
        src = locate(args.model)
        config = load_config(src)
        self.tok = load_tokenizer(src, config)
        def build():
            return build_model(src, config, seed=0).to(self.device).train()
        self.sources, targets, _, tgt_text = _pairs(args, self.tok)
        self.labels = targets["input_ids"].masked_fill(targets["attention_mask"] == 0, -100)
        # DeepSpeed's micro-batch setting counts samples for its logs; its forward takes any batch
        self.step, self.module = _engine(args.method, build, batch, args.lr)
        self.evals = held_out(len(self.labels), args.eval_samples, seed=0)  # bigfit's own held-out samples
        held = set(self.evals)
        self.train = [i for i in range(len(self.labels)) if i not in held]
        self.refs = [tgt_text[i] for i in self.evals]

    def run(self, batch: int, steps: int) -> tuple[list[float], float]:
        """`steps` steps of `batch` samples: (their times, the last loss)."""
        import torch

        times, loss = [], None
        if batch > int(os.environ.get("PEERS_OOM_ABOVE", 10**9)):  # the search's CPU check: an injected OOM
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected above {os.environ['PEERS_OOM_ABOVE']})")
        for i in range(steps):
            rows = [self.train[(i * batch + j) % len(self.train)] for j in range(batch)]
            inputs = {"input_ids": self.sources["input_ids"][rows].to(self.device),
                      "attention_mask": self.sources["attention_mask"][rows].to(self.device),
                      "labels": self.labels[rows].to(self.device)}
            _sync(self.device)
            t0 = time.perf_counter()
            loss = self.step(inputs)
            _sync(self.device)
            times.append(time.perf_counter() - t0)
        return times, float(loss)


def measure(args, batch: int) -> dict:
    """One method at one micro-batch: 2 untimed steps and --timed-steps more, then the evaluation."""
    import torch

    job = Job(args, batch)
    if job.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = job.run(batch, 2 + args.timed_steps)
    step_s = statistics.median(times[2:])
    out = {"method": args.method, "micro": batch, "step_s": round(step_s, 4), "loss": round(loss, 3),
           "train_s": round(step_s * args.train_samples / batch, 3),
           "tokens_per_s": round(batch * args.max_target_len / step_s, 1),
           "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if job.device.type == "cuda" else None,
           "host_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    out.update(_evaluate(args, job.module, job.tok, job.sources, job.refs, job.evals, job.device))
    return out


def probe(args, ok: int, bad: int | None) -> None:
    """Sizes upward in this process, from what is known (`ok` ran, `bad` did not: 0 and None for
    nothing): doubling until one fails, else bisecting; each size 2 steps, its outcome printed as it
    is known. Plain PyTorch frees a size that ran out of memory and goes on; under DeepSpeed the error
    ends the process (its engine does not recover) and the driver starts another from what it learnt."""
    import torch

    job = Job(args, max(ok, args.start))
    while True:
        size = _next(args, ok, bad)
        if (bad is not None and bad - ok <= args.resolution) or size > args.max_batch:
            return
        failed = False
        try:
            job.run(size, 2)  # raises on out-of-memory: the driver reads the size it was trying
        except torch.OutOfMemoryError:
            if not args.method.startswith("torch"):  # a DeepSpeed engine does not recover
                raise
            failed = True
        if failed:  # plain PyTorch goes on, once the traceback that held the step's tensors is gone
            job.module.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(f"OOM {size}", flush=True)
            bad = size
            continue
        print(f"RAN {size}", flush=True)
        ok = size


def _evaluate(args, module, tok, sources, refs, evals, device) -> dict:
    """Beam search over the held-out pairs and its BLEU against their targets."""
    import sacrebleu
    import torch

    from bigfit.training.evaluate import decodable

    module.eval()
    hyps, began = [], time.perf_counter()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for start in range(0, len(evals), args.eval_batch):
            rows = evals[start:start + args.eval_batch]
            ids = module.generate(input_ids=sources["input_ids"][rows].to(device),
                                  attention_mask=sources["attention_mask"][rows].to(device),
                                  num_beams=args.num_beams, max_new_tokens=args.max_new_tokens)
            hyps += tok.batch_decode(decodable(ids, len(tok)), skip_special_tokens=True)  # as bigfit decodes
    _sync(device)
    return {"eval_s": round(time.perf_counter() - began, 3), "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _child(args, *extra: str) -> subprocess.CompletedProcess | None:
    shared = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in SHARED]
    try:
        return subprocess.run([sys.executable, __file__, *extra, *shared], capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None


def _next(args, ok: int, bad: int | None) -> int:
    """The next size to try: --start, then doubled (or --step more) until one fails, then bisected."""
    if bad is not None:
        return (ok + bad) // 2
    return (ok + args.step if args.step else ok * 2) if ok else args.start


def _why(p: subprocess.CompletedProcess | None, timeout: int) -> str:
    """A failed child's reason: out of memory, else its last error line (a warning often follows it)."""
    if p is None:
        return f"timeout {timeout} s"
    tail = (p.stdout + p.stderr).strip().splitlines()
    if any("out of memory" in x.lower() for x in tail):
        return "out of memory"
    notes = [x for x in tail[:-40] if x.startswith("NOTE ")]  # an earlier fallback the tail would lose
    print("\n".join(notes + tail[-40:]), file=sys.stderr, flush=True)  # the whole story, into the driver's log
    errors = [x for x in tail if "Error" in x or "Exception" in x]
    return ((errors or tail)[-1] if tail else f"exit {p.returncode}")[:300]


def largest_batch(args) -> tuple[int, list]:
    """The largest micro-batch that runs (within --resolution), by probe processes: each goes upward
    until a size fails, then the next starts from what the others learnt."""
    ok, bad, tried = 0, None, []
    while bad is None or bad - ok > args.resolution:
        p = _child(args, "--probe", str(ok), str(bad or 0))
        said = [x.split() for x in (p.stdout if p else "").splitlines() if x.startswith(("RAN ", "OOM "))]
        tried += [[int(n), True if w == "RAN" else "out of memory"] for w, n in said]
        ok = max([ok, *(int(n) for w, n in said if w == "RAN")])
        bad = min([b for b in (bad, *(int(n) for w, n in said if w == "OOM")) if b is not None], default=None)
        size = _next(args, ok, bad)
        if p is not None and p.returncode == 0:  # went as far as it may
            break
        tried.append([size, _why(p, args.timeout)])
        if ok == 0 and "out of memory" not in tried[-1][1]:
            break  # not a size problem: the method fails
        bad = size
    return ok, tried


def _measured(args, micro: int) -> dict:
    p = _child(args, "--measure", str(micro))
    out = (p.stdout if p else "").splitlines()
    line = [x for x in out if x.startswith("RESULT ")]
    row = json.loads(line[-1][7:]) if line else {"micro": micro, "error": _why(p, args.timeout)}
    notes = [x[5:] for x in out if x.startswith("NOTE ")]  # DeepSpeed on torch's AdamW
    return {**row, "note": " ".join(notes)} if notes else row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--methods", default="torch,ds-z2,ds-z2-offload")
    ap.add_argument("--method", default="torch")
    ap.add_argument("--train-samples", type=int, default=1024)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--eval-batch", type=int, default=8)
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-source-len", type=int, default=128)
    ap.add_argument("--max-target-len", type=int, default=128)
    ap.add_argument("--timed-steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-batch", type=int, default=512, help="the doubling stops here")
    ap.add_argument("--json")
    ap.add_argument("--start", type=int, default=8, help="the first micro-batch tried")
    ap.add_argument("--step", type=int, default=0, help="grow by this many samples, not doubling, until one fails")
    ap.add_argument("--resolution", type=int, default=1, help="the search stops within this many samples")
    ap.add_argument("--probe", type=int, nargs=2, help=argparse.SUPPRESS)  # internal: a probe process (ok, bad)
    ap.add_argument("--measure", type=int, help=argparse.SUPPRESS)  # internal: the measured run at this size
    args = ap.parse_args()
    if args.probe:
        probe(args, args.probe[0], args.probe[1] or None)
        return
    if args.measure:
        print("RESULT " + json.dumps(measure(args, args.measure)), flush=True)
        return
    rows = []
    for method in args.methods.split(","):
        args.method = method
        began = time.time()
        micro, tried = largest_batch(args)
        row = {"method": method, "tried": tried}
        row.update(_measured(args, micro) if micro else {"error": f"no micro-batch ran: {tried[-1][1]}"})
        row["wall_s"] = round(time.time() - began)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| method | max BS | train s | eval s | BLEU | step s | tokens/s | peak GPU GB | host RSS GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = [r.get(k) for k in ("micro", "train_s", "eval_s", "bleu", "step_s", "tokens_per_s", "peak_gpu_gb",
                                    "host_rss_gb")]
        print(f"| {r['method']} | " + " | ".join("" if c is None else str(c) for c in cells)
              + (f" | {r['error']}" if "error" in r else "") + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
