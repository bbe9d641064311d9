"""Where a LoRA step's GPU time goes, by kernel kind (matmuls, attention, elementwise, reductions),
against a full fine-tune's: the planner rates LoRA 20-35% slow on the H200. Llama shapes from
config, random init on the device; peft's inject_adapter_in_model as bigfit's --lora does."""
import json, os, sys, time, re
import torch
from transformers import LlamaConfig, AutoModelForCausalLM

dev = "cuda" if torch.cuda.is_available() else "cpu"
big = dev == "cuda"
OUT = os.environ.get("OUT", "/tmp")
SHAPES = {"8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336),
          "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192),
          "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)}
KINDS = (("attention", r"flash|fmha|attention|sdpa"), ("matmul", r"gemm|cutlass|xmma|nvjet|matmul|sm90|sm80|ampere|cublas|mm_"),
         ("reduce", r"reduce|norm|softmax"), ("elementwise", r"elementwise|copy|fill|dropout|bernoulli|mul|add|cat|index|where"))

def kind(name):
    n = name.lower()
    return next((k for k, p in KINDS if re.search(p, n)), "other")

def run(size, lora, autocast, mbs, seq):
    import peft
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[size], vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192, use_cache=False)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if (lora or not autocast) else torch.float32)
    if lora:
        peft.inject_adapter_in_model(peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                                     bias="none"), model, adapter_name="default")
        for n, p in model.named_parameters():
            p.requires_grad = ".lora_" in n
            if ".lora_" in n and autocast:
                p.data = p.data.float()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=big)
    ids = torch.randint(0, 128000, (mbs, seq), device=dev)
    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for _ in range(2): step()
    ts = []
    for _ in range(3):
        if big: torch.cuda.synchronize()
        t = time.perf_counter(); step()
        if big: torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA] if big else [ProfilerActivity.CPU]) as p:
        step()
        if big: torch.cuda.synchronize()
    by = {}
    for e in p.key_averages():
        if big and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not big and not e.key.startswith("aten::"):
            continue
        k = kind(e.key)
        by[k] = by.get(k, 0) + (e.device_time_total if big else e.self_cpu_time_total) / 1e6
    top = sorted(((e.key[:90], round(e.device_time_total / 1e3, 1)) for e in p.key_averages()
                  if big and e.device_type == torch.autograd.DeviceType.CUDA), key=lambda x: -x[1])[:25]
    r = {"size": size, "lora": lora, "autocast": autocast, "batch": f"{mbs}x{seq}", "step_s": sorted(ts)[1],
         "kernel_s": {k: round(v, 4) for k, v in by.items()}, "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if big else None,
         "top": top}
    print(json.dumps(r), flush=True)
    with open(f"{OUT}/lora_kernels.jsonl", "a") as f:
        f.write(json.dumps(r) + "\n")
    del model, opt, params
    if big:
        torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()

size = sys.argv[1] if len(sys.argv) > 1 else ("8b" if big else "tiny")
mbs, seq = (4, 2048) if big else (2, 64)
for lora, autocast in ((True, True), (True, False), (False, False)):
    run(size, lora, autocast, mbs if lora else (2 if size == "8b" else mbs), seq)
if big:
    run("3b", False, True, 4, 2048)
    run("3b", False, False, 4, 2048)
