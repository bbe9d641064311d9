"""A Hugging Face Trainer script on bigfit's strategies: the lines marked `# bigfit` are the whole change.

Here (CPU, seconds): a tiny Llama made from a config, bigfit's byte-level tokenizer (no files), 48
in-memory texts, strategy="auto" (bigfit's planner picks: one process on a CPU gives `single`):

    python examples/hf_trainer.py

A real model on GPUs: every process runs the script (torchrun, accelerate launch or srun); the
model is loaded into host RAM (device_map="cpu": Trainer would otherwise move it to the GPU whole
before bigfit shards it); bigfit's strategy spreads it; Trainer's loop, lr schedule, logging,
evaluation, checkpoints (resume_from_checkpoint) and save_model work as they do without bigfit:

    torchrun --nproc-per-node 8 examples/hf_trainer.py --model meta-llama/Llama-3.1-8B \
        --strategy zero3 --bf16 --max-steps 1000 --output-dir out/llama8b
    python examples/hf_trainer.py --model Qwen/Qwen2.5-3B --strategy zero2-offload --bf16   # one 24 GB card

Replace the in-memory texts with your dataset (datasets.load_dataset); TrainingArguments give
bigfit its lr, weight decay, Adam settings, max_grad_norm, seed, precision (bf16/fp16) and batch
split (per_device_train_batch_size x gradient_accumulation_steps x processes).
"""
from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer, DataCollatorForLanguageModeling,
                          LlamaConfig, Trainer, TrainingArguments)

import bigfit.hf  # bigfit


def model_and_tokenizer(name: str | None):
    """The model named (loaded into host RAM) and its tokenizer; without a name a tiny Llama from a config."""
    if name:
        tokenizer = AutoTokenizer.from_pretrained(name)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, device_map="cpu"), tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return AutoModelForCausalLM.from_config(config), ByT5Tokenizer()


def texts(tokenizer, n: int = 48) -> Dataset:
    rows = [f"Question: what is {i} plus {i % 7}? Answer: {i + i % 7}." for i in range(n)]
    return Dataset.from_list([{"input_ids": tokenizer(t)["input_ids"]} for t in rows])


def main(argv=None) -> Trainer:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model name or directory (default: a tiny Llama from a config)")
    p.add_argument("--strategy", default="auto", help="bigfit's strategy: auto, single, ddp, zero2, zero3, zero2-offload, ...")
    p.add_argument("--output-dir", default="out/hf_trainer")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args(argv)
    model, tokenizer = model_and_tokenizer(a.model)
    data = texts(tokenizer)
    args = TrainingArguments(output_dir=a.output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=a.max_steps, learning_rate=1e-3, warmup_steps=2, logging_steps=1,
                             save_steps=max(1, a.max_steps // 2), eval_strategy="steps", eval_steps=max(1, a.max_steps // 2),
                             bf16=a.bf16, report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(8)),
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    bigfit.hf.use(trainer, strategy=a.strategy)  # bigfit
    trainer.train()
    trainer.save_model()  # a Hugging Face directory: AutoModelForCausalLM.from_pretrained(args.output_dir)
    return trainer


if __name__ == "__main__":
    main()
