"""A TRL SFTTrainer script on bigfit's strategies: the lines marked `# bigfit` are the whole change.

Here (CPU, seconds): a tiny Llama made from a config, bigfit's byte-level tokenizer (no files), 48
in-memory prompt/completion pairs (SFTTrainer tokenizes them and trains on the completions),
strategy="auto" (bigfit's planner picks):

    python examples/trl_sft.py

A real model on GPUs: every process runs the script (torchrun, accelerate launch or srun); the
model is loaded into host RAM (device_map="cpu": Trainer would otherwise move it to the GPU whole
before bigfit shards it):

    torchrun --nproc-per-node 4 examples/trl_sft.py --model Qwen/Qwen2.5-7B --strategy zero3 --bf16 \
        --max-steps 500 --output-dir out/sft
    python examples/trl_sft.py --model meta-llama/Llama-3.2-3B --strategy zero2-offload --bf16 --lora

--lora trains bigfit's LoRA adapters (lora=True; save_model writes the adapter directory, as peft
does); a peft_config given to SFTTrainer works as well (bigfit shards the PeftModel it makes).
Replace the pairs with your dataset (datasets.load_dataset("trl-lib/Capybara", split="train")).
"""
from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer, LlamaConfig
from trl import SFTConfig, SFTTrainer

import bigfit.hf  # bigfit


def model_and_tokenizer(name: str | None):
    """The model named (loaded into host RAM) and its tokenizer; without a name a tiny Llama from a config."""
    if name:
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, device_map="cpu"), AutoTokenizer.from_pretrained(name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return AutoModelForCausalLM.from_config(config), ByT5Tokenizer()


def pairs(n: int = 48) -> Dataset:
    return Dataset.from_list([{"prompt": f"What is {i} plus {i % 7}?", "completion": f" {i + i % 7}."} for i in range(n)])


def main(argv=None) -> SFTTrainer:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model name or directory (default: a tiny Llama from a config)")
    p.add_argument("--strategy", default="auto", help="bigfit's strategy: auto, single, ddp, zero2, zero3, zero2-offload, ...")
    p.add_argument("--output-dir", default="out/trl_sft")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--lora", action="store_true", help="train bigfit's LoRA adapters instead of every weight")
    a = p.parse_args(argv)
    model, tokenizer = model_and_tokenizer(a.model)
    args = SFTConfig(output_dir=a.output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     max_steps=a.max_steps, learning_rate=1e-3, warmup_steps=2, logging_steps=1, max_length=64,
                     save_steps=max(1, a.max_steps // 2), bf16=a.bf16, report_to=[],
                     use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=pairs(), processing_class=tokenizer)
    bigfit.hf.use(trainer, strategy=a.strategy, lora=a.lora)  # bigfit
    trainer.train()
    trainer.save_model()  # a Hugging Face directory (the adapter directory with --lora)
    return trainer


if __name__ == "__main__":
    main()
