"""bigfit from the user's code against what a user would pick instead, one method a process, one JSON
line each (into --out as it comes). A Llama-shaped decoder from config (random init), bf16, micro-batch
MBS x SEQ, the first WARMUP steps not timed; tokens/s over the timed steps.

  trainer-bigfit      Hugging Face Trainer, bigfit.hf.use(trainer, strategy=zero2-offload)
  trainer-deepspeed   the same Trainer with DeepSpeed ZeRO-2 offload (TrainingArguments(deepspeed=...))
  loop-prepare        a plain loop through bigfit.prepare(strategy=zero2-offload)
  optim-bigfit        a plain loop with bigfit.optim.OffloadAdamW
  optim-torchao       a plain loop with torchao's CPUOffloadOptimizer
  optim-deepspeed     a plain loop through deepspeed.initialize, ZeRO-2 with the optimizer offloaded
  auto                bigfit.prepare(strategy="auto")'s pick (bigfit train --strategy auto's: userloop_gpu.sh)

  python benchmarks/userloop.py optim-bigfit --size 3b --mbs 4 --seq 2048 --out results.jsonl
  python benchmarks/userloop.py all --size tiny --device cpu      (the script's own check, here)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SIZES = {  # hidden, layers, heads, kv heads, intermediate, vocab (the peers' shapes: shared/bench/peers.py)
    "tiny": (64, 2, 4, 2, 128, 512), "1b": (2048, 16, 32, 8, 8192, 128256), "3b": (3072, 28, 24, 8, 8192, 128256)}
METHODS = ("trainer-bigfit", "trainer-deepspeed", "loop-prepare", "optim-bigfit", "optim-torchao", "optim-deepspeed",
           "auto")
LR = 1e-5


def model_of(size: str, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, heads, kv, inter, vocab = SIZES[size]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=inter, vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    return model


def batches(a, vocab: int, n: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (a.mbs, a.seq), generator=g) for _ in range(n)]


def timed(step, xs, warmup: int) -> list[float]:
    import torch

    times = []
    for i, x in enumerate(xs):
        t0 = time.perf_counter()
        step(x)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def plain_loop(a, make):
    """A plain loop over `make(model) -> (step(x), close())`."""
    model = model_of(a.size, a.device)
    step, close = make(model)
    times = timed(step, [x.to(a.device) for x in batches(a, model.config.vocab_size, a.steps)], a.warmup)
    close()
    return times


def loop_prepare(a):
    import bigfit

    def make(model):
        engine = bigfit.prepare(model, strategy="zero2-offload", lr=LR, max_grad_norm=1.0)

        def step(x):
            engine.backward(engine.model(input_ids=x, labels=x).loss)
            engine.step()
        return step, engine.close
    return plain_loop(a, make)


def optimizer_loop(a, make_opt):
    def make(model):
        opt = make_opt(model)

        def step(x):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        return step, lambda: None
    return plain_loop(a, make)


def optim_bigfit(a):
    from bigfit.optim import OffloadAdamW

    return optimizer_loop(a, lambda m: OffloadAdamW(m.parameters(), lr=LR, weight_decay=0.0, max_grad_norm=1.0))


def optim_torchao(a):
    import torch
    from torchao.optim import CPUOffloadOptimizer

    return optimizer_loop(a, lambda m: CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, lr=LR, fused=True))


def ds_config(a) -> dict:
    """DeepSpeed ZeRO-2 with the optimizer in host RAM: the seed's config (bf16, pinned, overlap)."""
    return {"train_micro_batch_size_per_gpu": a.mbs, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True}}}


def optim_deepspeed(a):
    import deepspeed

    def make(model):
        cfg = {**ds_config(a), "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def step(x):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        return step, lambda: None
    return plain_loop(a, make)


def trainer(a, use_bigfit: bool):
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = model_of(a.size, a.device)
    rows = [{"input_ids": x.tolist(), "labels": x.tolist()} for b in batches(a, model.config.vocab_size, a.steps) for x in b]
    times, last = [], [None]

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            last[0] = time.perf_counter()

        def on_step_end(self, args, state, *rest, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if state.global_step > a.warmup:
                times.append(time.perf_counter() - last[0])

    args = TrainingArguments(output_dir="/tmp/bigfit-bench-trainer", per_device_train_batch_size=a.mbs, max_steps=a.steps,
                             learning_rate=LR, bf16=a.device == "cuda", use_cpu=a.device == "cpu", logging_steps=10**6,
                             save_strategy="no", report_to=[], lr_scheduler_type="constant", max_grad_norm=1.0,
                             deepspeed=None if use_bigfit else ds_config(a), dataloader_drop_last=True)
    t = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
    if use_bigfit:
        import bigfit.hf

        bigfit.hf.use(t, strategy="zero2-offload")
    t.train()
    return times


def auto(a) -> str:
    """bigfit.prepare(strategy="auto")'s pick for the model (from its directory) and a batch of MBS x SEQ."""
    import bigfit
    import torch

    path = "/tmp/bigfit-bench-model"
    model_of(a.size, "meta").config.save_pretrained(path)
    x = torch.zeros(a.mbs, a.seq, dtype=torch.long)
    with bigfit.prepare(path, strategy="auto", sample={"input_ids": x, "labels": x}) as engine:
        return engine.plan["strategy"]


RUNS = {"trainer-bigfit": lambda a: trainer(a, True), "trainer-deepspeed": lambda a: trainer(a, False),
        "loop-prepare": loop_prepare, "optim-bigfit": optim_bigfit, "optim-torchao": optim_torchao,
        "optim-deepspeed": optim_deepspeed}


def one(a) -> dict:
    import torch

    row = {"method": a.method, "size": a.size, "mbs": a.mbs, "seq": a.seq}
    try:
        times = RUNS[a.method](a)
        row.update(step_s=round(sum(times) / len(times), 4), tokens_per_s=round(a.mbs * a.seq * len(times) / sum(times), 1))
        if torch.cuda.is_available():
            row["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    except Exception as e:  # noqa: BLE001  a peer missing here is a row saying so
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("method", choices=(*METHODS, "all"))
    p.add_argument("--size", default="3b", choices=SIZES)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.method == "all":  # each method in a process of its own: host memory and pinned buffers start clean
        for m in METHODS[:-1]:
            subprocess.run([sys.executable, __file__, m, *sys.argv[2:]], check=False)
        return
    row = {"method": "auto", "size": a.size, "picked": auto(a)} if a.method == "auto" else one(a)
    print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
