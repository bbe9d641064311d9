"""Device-map model parallelism on one GPU plus the host: a T5 split over cuda:0 and cpu, against the
same model unsplit on cuda:0, for a training step and for beam-search generation.

Layouts (--layouts): unsplit (all on cuda:0); flat (encoder on cuda:0, decoder on cpu); split (each
stack's first half on cuda:0, second half on cpu); tail (all on cuda:0 but the last --tail decoder
blocks: a model just too big for its GPU); each split layout again with every --chunks count
(GPipe in one process: the GPU works on one micro-batch while the CPU works on another), and with
--sequential once more with a tick's host segments run after its GPU segments instead of beside
them (device_map/schedule.py). Random init from config, random tokens, fp32 master weights with
autocast in --precision on both devices, fused AdamW.

  python benchmarks/device_map.py --out device_map.jsonl             # t5-large's shape, on the GPU machine
  python benchmarks/device_map.py --other cuda:1 --out device_map.jsonl   # two GPUs instead of GPU + host
  python benchmarks/device_map.py --layouts unsplit,tail --chunks 2,4 --sequential --batch 64 --beams 0
  python benchmarks/device_map.py --tiny --out /tmp/dm.jsonl          # a smoke test on a CPU
Each row: step time, generate time, cross-device copies per step and per generate, peak GPU memory,
and the loss against the unsplit model's (the same weights and batch); with CUDA, `host_syncs`: the
synchronising CUDA calls of one step (torch's sync debug mode; the chunked forward should make none
of its own: what remains comes from the model, e.g. a mask check). `--trace DIR` writes a Chrome
trace of one step per layout (torch.profiler), where the devices' overlap can be seen.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import time
import warnings

import torch

SHAPES = {"tiny": dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=3, vocab_size=384),
          "base": dict(d_model=768, d_ff=3072, d_kv=64, num_heads=12, num_layers=12, num_decoder_layers=12,
                       vocab_size=32128),
          "large": dict(d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24, num_decoder_layers=24,
                        vocab_size=32128),
          "3b": dict(d_model=1024, d_ff=16384, d_kv=128, num_heads=32, num_layers=24, num_decoder_layers=24,
                     vocab_size=32128)}  # t5-3b's public config


def layouts(cfg, gpu: str, other: str, names: list[str], chunks: list[int], tail: int,
            sequential: bool) -> list[tuple[str, dict | None, int, bool]]:
    """(name, map, chunks, host beside) rows: each layout unchunked, then with each chunk count
    (and with the host segments after the GPU segments instead of beside them, if `sequential`)."""
    enc, dec = cfg.num_layers, cfg.num_decoder_layers
    maps = {"unsplit": None,
            "flat": {"encoder": {gpu: list(range(enc))}, "decoder": {other: list(range(dec))}},
            "split": {"encoder": {gpu: list(range(enc // 2)), other: list(range(enc // 2, enc))},
                      "decoder": {gpu: list(range(dec // 2)), other: list(range(dec // 2, dec))}},
            "tail": {"encoder": {gpu: list(range(enc))},  # the last blocks overflow: a model just too big
                     "decoder": {gpu: list(range(dec - tail)), other: list(range(dec - tail, dec))}}}
    rows = [(name, maps[name] and {**maps[name], "main_device": gpu}, 1, True) for name in names]
    for name, spec, _, _ in rows[:]:
        for c in chunks if spec else ():
            rows.append((f"{name} chunks={c}", spec, c, True))
            if sequential:
                rows.append((f"{name} chunks={c} host after", spec, c, False))
    return rows


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _autocast(dtype):
    from contextlib import ExitStack

    stack = ExitStack()
    if dtype is not None:
        for dev in ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",):
            stack.enter_context(torch.autocast(dev, dtype=dtype))
    return stack


def run(name: str, base, spec, chunks: int, batch: dict, gen_batch: dict, args, dtype, gpu: str) -> dict:
    from bigfit.device_map import count_copies, parallelize, train_step

    model = copy.deepcopy(base)
    if spec is None:  # the reference: plain model on one device; train_step needs the hooks, so a
        model.to(gpu)  # one-device map (no copies) gives it the same code path
        spec = {"encoder": {gpu: list(range(base.config.num_layers))},
                "decoder": {gpu: list(range(base.config.num_decoder_layers))}}
    parallelize(model, spec)
    if args.compile:  # bigfit's --compile (each block's forward), here on the first device's blocks only, or all
        from bigfit.engine.compiling import apply_compile

        on_gpu = lambda blk: args.compile == "all" or next(blk.parameters()).device == torch.device(gpu)  # noqa: E731
        apply_compile(model, where=on_gpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    # generate first, from the weights every layout shares, so that "same tokens" compares like with like
    gen_in = {k: v.to(torch.device(gpu)) for k, v in gen_batch.items()}
    gen_time, gen_copies, tokens = _generate(model, gen_in, args, dtype) if args.beams else (0.0, 0, [])
    on_main = {k: v.to(torch.device(gpu)) for k, v in batch.items()}
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        _sync()
        t0 = time.perf_counter()
        with count_copies() as copies, _autocast(dtype):
            loss = train_step(model, on_main, chunks=chunks)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    syncs = _count_syncs(lambda: train_step(model, on_main, chunks=chunks), dtype)  # warm steps, not timed
    if args.trace:
        _trace(lambda: train_step(model, on_main, chunks=chunks), dtype, f"{args.trace}/{name.replace(' ', '_')}.json")
    opt.zero_grad(set_to_none=True)
    del model, opt  # this layout's GPU memory back before the next one's
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"layout": name, "chunks": chunks, "step_s": sum(times) / len(times), "first_loss": losses[0],
            "copies_per_step": copies.forward + copies.backward, "copied_mb_per_step": copies.bytes / 1e6,
            "generate_s": gen_time, "copies_per_generate": gen_copies, "tokens": tokens, "peak_gpu_gb": peak / 1e9,
            "host_syncs": syncs}


def _count_syncs(step, dtype) -> int | None:
    """Synchronising CUDA calls during one step (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught, _autocast(dtype):
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _trace(step, dtype, path: str) -> None:
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path), exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof, _autocast(dtype):
        step()
        _sync()
    prof.export_chrome_trace(path)


@torch.no_grad()
def _generate(model, b: dict, args, dtype) -> tuple[float, int, list]:
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from bigfit.device_map import count_copies

    model.eval()
    times = []
    for i in range(2):  # the first call warms up
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        _sync()
        t0 = time.perf_counter()
        with count_copies() as copies, _autocast(dtype), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(**b, num_beams=args.beams, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, past_key_values=cache)
        _sync()
        times.append(time.perf_counter() - t0)
    model.train()
    return times[-1], copies.forward, out[0].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SHAPES, default="large")
    p.add_argument("--tiny", action="store_true", help="--size tiny with short lengths: a CPU smoke test")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--src-len", type=int, default=256)
    p.add_argument("--tgt-len", type=int, default=64)
    p.add_argument("--chunks", default="4", help="chunk counts, comma-separated")
    p.add_argument("--layouts", default="unsplit,flat,split", help="of unsplit, flat, split, tail")
    p.add_argument("--tail", type=int, default=1, help="tail: the last TAIL decoder blocks on the second device")
    p.add_argument("--sequential", action="store_true",
                   help="chunked rows again with the host segments after the GPU segments (not beside them)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--beams", type=int, default=4, help="0: no generation")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--gen-batch", type=int, default=4)
    p.add_argument("--other", default="cpu", help="the second device (cpu; or cuda:1 on a two-GPU machine)")
    p.add_argument("--compile", choices=("gpu", "all"), help="torch.compile each block's forward: those on "
                   "the first device (gpu), or all")
    p.add_argument("--out", help="append one JSON line per layout here")
    p.add_argument("--trace", help="write a Chrome trace of one step per layout into this folder")
    args = p.parse_args()
    if args.compile:  # one dynamic graph per block kind, but a micro-batch size equal to one of the model's
        torch._dynamo.config.cache_size_limit = 64  # own sizes (64 = T5-large's d_kv) is one symbol with it: recompiles
    if args.tiny:
        args.size, args.src_len, args.tgt_len, args.new_tokens = "tiny", 16, 8, 8
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(**SHAPES[args.size], dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0,
                   pad_token_id=0, eos_token_id=1, use_cache=False)
    torch.manual_seed(0)
    base = T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (args.batch, args.src_len), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.randint(2, cfg.vocab_size, (args.batch, args.tgt_len), generator=g)}
    gen = {"input_ids": ids[:args.gen_batch], "attention_mask": torch.ones_like(ids[:args.gen_batch])}
    gpu = "cuda:0" if torch.cuda.is_available() else "cpu:1"  # on a CPU: a virtual device stands in for the GPU
    dtype = {"fp32": None, "bf16": torch.bfloat16}[args.precision]
    meta = {"machine": platform.node(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "size": args.size,
            "params_m": sum(q.numel() for q in base.parameters()) / 1e6, "batch": args.batch, "src_len": args.src_len,
            "tgt_len": args.tgt_len, "precision": args.precision, "devices": f"{gpu}+{args.other}", "beams": args.beams,
            "new_tokens": args.new_tokens, "compile": args.compile}
    import transformers

    meta["transformers"] = transformers.__version__
    rows = []
    print(f"T5 {args.size} ({meta['params_m']:.0f}M parameters) on {gpu} + {args.other}, batch {args.batch} x "
          f"{args.src_len}/{args.tgt_len}, {args.precision}; generate {args.gen_batch} x beams {args.beams} x {args.new_tokens} tokens")
    print(f"{'layout':<28}{'step s':>9}{'x unsplit':>10}{'copies':>8}{'MB':>9}{'gen s':>8}{'x unsplit':>10}"
          f"{'gen copies':>11}{'GPU GB':>8}{'loss delta':>12}{'syncs':>7}  same tokens")
    from bigfit.device_map import schedule

    rows_to_run = layouts(cfg, gpu, args.other, args.layouts.split(","), [int(c) for c in args.chunks.split(",")],
                          args.tail, args.sequential)
    for name, spec, chunks, beside in rows_to_run:
        schedule.HOST_BESIDE = beside
        r = {**meta, "host_beside": beside, **run(name, base, spec, chunks, batch, gen, args, dtype, gpu)}
        rows.append(r)
        ref = rows[0]
        print(f"{name:<28}{r['step_s']:>9.3f}{r['step_s'] / ref['step_s']:>10.2f}{r['copies_per_step']:>8}"
              f"{r['copied_mb_per_step']:>9.1f}{r['generate_s']:>8.2f}"
              f"{r['generate_s'] / max(ref['generate_s'], 1e-9):>10.2f}"
              f"{r['copies_per_generate']:>11}{r['peak_gpu_gb']:>8.2f}{r['first_loss'] - ref['first_loss']:>12.2e}"
              f"{'-' if r['host_syncs'] is None else r['host_syncs']:>7}"
              f"  {r['tokens'] == ref['tokens']}", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
