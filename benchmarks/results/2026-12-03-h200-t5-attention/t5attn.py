"""Which SDPA path T5 takes on CUDA under autocast, and what it costs (memory, step time)."""
import json, os, time
import torch
from transformers import T5Config, AutoModelForSeq2SeqLM

dev = "cuda" if torch.cuda.is_available() else "cpu"
big = dev == "cuda"
out = os.environ.get("OUT", "/tmp")
def cfg(impl):
    kw = dict(d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24, num_decoder_layers=24) if big else \
         dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2)
    c = T5Config(**kw, vocab_size=32128, tie_word_embeddings=True, dropout_rate=0.0, decoder_start_token_id=0,
                 pad_token_id=0, eos_token_id=1, use_cache=False)
    c._attn_implementation = impl
    return c

def run(impl, b, mode):
    torch.manual_seed(0)
    m = AutoModelForSeq2SeqLM.from_config(cfg(impl)).to(dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=big)
    ids = torch.randint(2, 32000, (b, 256), device=dev); lab = torch.randint(2, 32000, (b, 64), device=dev)
    def step():
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = m(input_ids=ids, attention_mask=torch.ones_like(ids), labels=lab).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    step(); step()
    if big: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    ts = []
    for _ in range(3):
        t = time.perf_counter(); step()
        if big: torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    r = {"impl": impl, "batch": b, "mode": mode, "step_s": sorted(ts)[1],
         "peak": torch.cuda.max_memory_allocated() if big else None}
    if mode == "profile":
        from torch.profiler import profile, ProfilerActivity
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if big else [])
        with profile(activities=acts) as p:
            step()
            if big: torch.cuda.synchronize()
        ev = p.key_averages()
        attn = [(e.key, e.count, round((e.device_time_total if big else e.cpu_time_total) / 1e3, 2)) for e in ev
                if any(s in e.key.lower() for s in ("attention", "fmha", "softmax", "efficient", "flash", "math"))]
        r["attention_ops"] = sorted(attn, key=lambda x: -x[2])[:25]
        r["cpu_ops"] = sum(e.count for e in ev if e.key.startswith("aten::"))
    print(json.dumps(r), flush=True)
    with open(f"{out}/t5attn.jsonl", "a") as f: f.write(json.dumps(r) + "\n")
    del m, opt
    if big: torch.cuda.empty_cache()

print(torch.__version__, __import__("transformers").__version__, flush=True)
if big:
    print("flash", torch.backends.cuda.flash_sdp_enabled(), "mem", torch.backends.cuda.mem_efficient_sdp_enabled(),
          "math", torch.backends.cuda.math_sdp_enabled(), "bf16 reduction math", torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed(), flush=True)
for impl in ("sdpa", "eager"):
    run(impl, 8, "profile")
    for b in ((32, 64) if big else (2,)):
        run(impl, b, "time")
