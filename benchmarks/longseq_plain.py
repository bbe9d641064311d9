"""The plain Hugging Face row of benchmarks/longseq.py, one sequence length in this process: what a user
writes by hand for long sequences. A Llama-shaped model from its config (random init, a block at a time
on the device), gradient checkpointing (`gradient_checkpointing_enable`, use_reentrant False), weights
in bf16 on a GPU (fp32 on a CPU), one sample of SEQ tokens, STEPS steps; the first is not timed.

  full    every weight trained, torch AdamW (fused on CUDA: no foreach temporaries) over bf16 weights
  lora    peft LoRA r 16, alpha 32 on q/k/v/o and the MLP's gate/up/down; AdamW over the adapters
  qlora   the same over bitsandbytes NF4 base layers (double quantisation, bf16 compute), quantized a
          block at a time as they are made; embeddings, norms and the head stay bf16 (peft's
          prepare_model_for_kbit_training would make them fp32: more memory, so left out here)

Peak memory: torch's max_memory_allocated on CUDA (bigfit's metrics.jsonl reads the same), the
process's peak RSS on a CPU. Tokens: SEQ - 1 a step (the tokens with a loss, as bigfit counts them).
"""
from __future__ import annotations

import resource
import time

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _init_(module) -> None:
    """Random values for a module made with `to_empty`: matrices N(0, 0.02), vectors (norms) ones."""
    import torch

    with torch.no_grad():
        for p in module.parameters(recurse=False):
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)


def _quantize_linears(block, dtype) -> None:
    """Each nn.Linear of `block` replaced by a bitsandbytes NF4 Linear4bit made from its weight."""
    import bitsandbytes as bnb
    import torch

    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=dtype,
                                      compress_statistics=True, quant_type="nf4", device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                             compress_statistics=True, module=q)
                setattr(parent, name, q.to(child.weight.device))  # the move quantizes


def build(cfg, device: str, dtype, quantize: bool):
    """The model made on the meta device, then materialised a module at a time on `device` (a 70B in
    bf16 would not fit host RAM or the GPU before quantizing); RoPE's buffers made again there."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to(dtype)
    for block in model.model.layers:
        block.to_empty(device=device)
        for m in block.modules():
            _init_(m)
        if quantize:
            _quantize_linears(block, dtype)
    for m in (model.model.embed_tokens, model.model.norm, model.lm_head):
        m.to_empty(device=device)
        _init_(m)
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    model.config.use_cache = False
    return model


def prepared(model, mode: str):
    """Checkpointing on, then the adapters for lora / qlora; the parameters the optimizer steps."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "full":
        return model, list(model.parameters())
    from peft import LoraConfig, get_peft_model

    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                             task_type="CAUSAL_LM"))
    return model, [p for p in model.parameters() if p.requires_grad]


def train(model, params, seq: int, steps: int, vocab: int, device: str) -> tuple[list[float], float]:
    """STEPS steps on one random sample of SEQ tokens: each step's seconds after the first, the last loss."""
    import torch

    opt = torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")
    x = torch.randint(3, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, loss = [], float("nan")
    for i in range(steps):
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()  # synchronizes
        del out
        if i or steps == 1:
            times.append(time.perf_counter() - t0)
    return times, loss


def row(cfg, mode: str, seq: int, steps: int) -> dict:
    """One plain row: tokens/s, peak memory, the last loss; an out-of-memory error as the row's error."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    r = {"ok": False, "tokens_per_s": None, "peak_gb": None, "peak_of": "gpu" if device == "cuda" else "host",
         "error": None}
    if mode == "qlora":  # a CPU quantizes too (bitsandbytes' CPU backend): the check here
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            return {**r, "error": f"skipped: bitsandbytes not importable ({e})"}
    try:
        model, params = prepared(build(cfg, device, dtype, mode == "qlora"), mode)
        times, loss = train(model, params, seq, steps, cfg.vocab_size, device)
        r.update(ok=True, tokens_per_s=round((seq - 1) * len(times) / sum(times), 1), loss=round(loss, 4),
                 step_s=round(sum(times) / len(times), 3))
    except torch.OutOfMemoryError as e:
        r["error"] = "OOM: " + str(e).splitlines()[0][:240]
    except Exception as e:  # noqa: BLE001  the row says what failed
        r["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    if device == "cuda":
        r["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    else:
        r["peak_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)
    return r
