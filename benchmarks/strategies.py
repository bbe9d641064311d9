"""Peak memory and throughput of every bigfit strategy on one workload, next to its peers.

The workload is ../shared/bench/peers.py's: a Llama-shaped decoder from config (random init, random
tokens), bf16, AdamW, micro-batch x sequence tokens per step. Each strategy runs in its own process
(clean peak-memory counters) through bigfit's own parallel.apply / build_optimizer / train_step.

  python benchmarks/strategies.py --size 1b --mbs 4 --seq 2048 --out results.jsonl
  python benchmarks/strategies.py one zero3 --size 1b ...        (one strategy, one JSON line)
  python benchmarks/strategies.py --strategies zero2-offload,zero2-offload+delayed --accum 4 ...
On one GPU, ddp and zero1 are the plain model (nothing to reduce or shard), so they are not repeated.
"+delayed" runs the strategy with --delayed-update, "+eager" with --max-grad-norm 0 (no clipping: the
offload engine then steps each bucket during backward), "+torchadam" with torch's fused AdamW as the
engine's host step instead of bigfit's kernel (kernels/cpu_adam.py), "+noclip" without gradient
clipping (the peers' setting) for any strategy. "pipeline+SCHEDULE" (gpipe, 1f1b, interleaved;
under torchrun, one stage per GPU) with `--chunks` micro-batches per micro-batch. `--accum N`: N micro-batches per step.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import statistics
import subprocess
import sys
import time

STRATEGIES = ("single", "zero2", "zero3", "zero2-offload", "zero3-offload")
SIZES = {"tiny": (64, 2, 4, 2, 128, 384),  # a smoke test of this script on a CPU
         "1b": (2048, 16, 32, 8, 8192, 128256), "3b": (3072, 28, 24, 8, 8192, 128256),
         "6b": (4096, 24, 32, 8, 14336, 128256),  # 6.3B: benchmarks/largest_model.py at 24 layers
         "8b": (4096, 32, 32, 8, 14336, 128256),  # as ../shared/bench/peers.py's
         "11b": (4096, 45, 32, 8, 14336, 128256)}  # 10.9B: the largest that trained on one H200 + 125 GiB


def nvme_tier() -> tuple[str, float]:
    """The disk tier's directory and GB of states kept in RAM: BIGFIT_NVME_DIR, BIGFIT_NVME_HOST_GB."""
    return os.environ.get("BIGFIT_NVME_DIR", "/tmp/bigfit-nvme"), float(os.environ.get("BIGFIT_NVME_HOST_GB", "0"))


def run_one(strategy: str, size: str, mbs: int, seq: int, steps: int, warmup: int, accum: int = 1,
            ckpt: bool = False, chunks: int | None = None) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bigfit.settings.config import TrainConfig
    from bigfit.common.distributed import init_runtime
    from bigfit.parallel import plan_for
    from bigfit.parallel.apply import apply
    from bigfit.layout.mesh import with_mesh
    from bigfit.job.resolution import resolve
    from bigfit.engine import build_optimizer
    from bigfit.training.step import train_step

    h, layers, heads, kv, inter, vocab = SIZES[size]
    mc = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                     intermediate_size=inter, vocab_size=vocab, max_position_embeddings=8192,
                     attn_implementation="sdpa", tie_word_embeddings=False, use_cache=False)
    name = strategy
    strategy, *variants = strategy.split("+")
    variant = variants[0] if variants else ""
    # the engine steps during backward only without clipping; "+noclip": the peers' setting (they do not clip)
    clip = 0.0 if "eager" in variants or "noclip" in variants else 1.0
    # +devgrads: gradients wait on the GPU (offload_grads device); NVMe: BIGFIT_NVME_DIR, BIGFIT_NVME_HOST_GB
    tier = dict(offload_grads="device") if "devgrads" in variants else {}
    if "torchadam" in variants:  # the engine's host step with torch's fused AdamW (fp32 gradients), not cpu_adam.py's
        os.environ["BIGFIT_CPU_ADAM"] = "0"
    if strategy == "zero2-offload-nvme":
        tier.update(zip(("nvme_dir", "nvme_host_gb"), nvme_tier()))
    rt = init_runtime(group_for_one=plan_for(strategy, 1).engine == "fsdp")
    pipe = dict(pipeline_schedule=variant, chunks=chunks) if strategy == "pipeline" else {}
    data = 1 if strategy == "pipeline" else rt.world_size  # pipeline stages all read the same batch
    job = resolve(TrainConfig(strategy=strategy, precision="bf16", batch_size=mbs * accum * data,
                              micro_batch_size=mbs, lr=1e-4, delayed_update="delayed" in variants,
                              activation_checkpointing=ckpt, max_grad_norm=clip, **pipe, **tier), rt.world_size)
    cfg = job.cfg
    torch.manual_seed(0)
    with torch.device("cpu" if strategy == "zero3-offload" else rt.device):
        model = LlamaForCausalLM(mc)
    n = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * (n - vocab * h) + 12 * layers * h * seq
    plan = job.plan
    rt = with_mesh(rt, plan)
    engine = apply(model, plan, cfg, rt)
    build_optimizer(engine, cfg)
    traced = getattr(engine, "engine", None)  # the offload engine's own timeline, where there is one
    g = torch.Generator().manual_seed(0)
    times = []
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trace_from = None
    for i in range(warmup + steps):
        if i == warmup + steps - 2 and traced is not None:  # the engine's timeline of the last 2 steps
            traced.trace, trace_from = [], time.perf_counter()
        micro = []
        for _ in range(accum):
            ids = torch.randint(0, vocab, (mbs, seq), generator=g).tolist()
            micro.append([{"input_ids": x, "labels": x} for x in ids])
        sync()
        t0 = time.perf_counter()
        out = train_step(engine, micro, pad_id=0, seq2seq=False, rt=rt, lr=1e-4, max_grad_norm=clip)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    engine.flush()
    step_s = statistics.median(times)
    tok_s = accum * mbs * seq / step_s
    return {"method": f"bigfit {name}", "params_b": round(n / 1e9, 3), "mbs": mbs, "seq": seq, "accum": accum,
            "step_s": round(step_s, 3), "step_times": [round(t, 3) for t in times], "tok_s": round(tok_s),
            "tflops": round(flops_per_token * tok_s / 1e12, 1),
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if gpu else None,
            "host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
            "loss": round(out["loss"], 3),
            "host_adam": ("kernel" if traced.kernel else "torch") if traced is not None else None,
            "trace": [(w, b, round(t0 - trace_from, 4), round(t1 - trace_from, 4)) for w, b, t0, t1 in traced.trace]
            if trace_from else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="all")
    ap.add_argument("strategy", nargs="?")
    ap.add_argument("--size", default="1b")
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=None, help="pipeline: micro-batches per micro-batch")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--timeout", type=int, default=300, help="seconds for one strategy's process")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.mode == "one":
        if os.environ.get("BIGFIT_STACKS_AFTER"):  # a run that hangs shows where, every so many seconds
            faulthandler.dump_traceback_later(float(os.environ["BIGFIT_STACKS_AFTER"]), repeat=True)
        try:
            r = run_one(a.strategy, a.size, a.mbs, a.seq, a.steps, a.warmup, a.accum, chunks=a.chunks)
        except Exception as e:  # OOM and friends: one line, keep going
            r = {"method": f"bigfit {a.strategy}", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        if os.environ.get("RANK", "0") == "0":  # under torchrun (benchmarks/scaling.py): rank 0 reports
            print("RESULT " + json.dumps(r), flush=True)
        return
    for s in a.strategies.split(","):
        cmd = [sys.executable, __file__, "one", s, "--size", a.size, "--mbs", str(a.mbs), "--seq", str(a.seq),
               "--steps", str(a.steps), "--warmup", str(a.warmup), "--accum", str(a.accum)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired as e:
            p = subprocess.CompletedProcess(cmd, 124, "", f"timed out after {e.timeout} s; its last output: "
                                            + _text(e.stderr)[-6000:])
        lines = [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("RESULT ")]
        r = json.loads(lines[-1][7:]) if lines else {"method": f"bigfit {s}", "error": (p.stdout + p.stderr)[-6500:]}
        print(json.dumps(r), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


if __name__ == "__main__":
    main()
