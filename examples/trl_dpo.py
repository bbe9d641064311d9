"""A TRL DPOTrainer script on bigfit's strategies: the lines marked `# bigfit` are the whole change.

Here (CPU, seconds): a tiny Llama made from a config, bigfit's byte-level tokenizer (no files), 48
in-memory preference triples (prompt, chosen, rejected), strategy="auto" (bigfit's planner picks):

    python examples/trl_dpo.py

bigfit spreads the policy (trainer.model); the reference model stays DPOTrainer's, as it makes it
(a frozen copy run without gradients, on each process's device; with a peft policy there is none:
DPOTrainer disables the adapters for the reference pass). A model made from a config has no name
DPOTrainer could load a reference from, so this script passes a copy. On GPUs every process runs
the script (torchrun, accelerate launch or srun), the policy loaded into host RAM (device_map="cpu"):

    torchrun --nproc-per-node 8 examples/trl_dpo.py --model Qwen/Qwen2.5-7B-Instruct --strategy zero3 --bf16 \
        --max-steps 500 --output-dir out/dpo

The reference is a whole copy on each GPU: for a model that does not fit whole, train a LoRA policy
(peft_config=...) so that no reference copy exists, or precompute_ref_log_probs=True.
Replace the triples with your dataset (datasets.load_dataset("trl-lib/ultrafeedback_binarized")).
"""
from __future__ import annotations

import argparse
import copy

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer, LlamaConfig
from trl import DPOConfig, DPOTrainer

import bigfit.hf  # bigfit


def model_and_tokenizer(name: str | None):
    """The model named (loaded into host RAM) and its tokenizer; without a name a tiny Llama from a config."""
    if name:
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, device_map="cpu"), AutoTokenizer.from_pretrained(name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return AutoModelForCausalLM.from_config(config), ByT5Tokenizer()


def triples(n: int = 48) -> Dataset:
    return Dataset.from_list([{"prompt": f"What is {i} plus {i % 7}?", "chosen": f" {i + i % 7}.",
                               "rejected": f" {i + i % 7 + 1}."} for i in range(n)])


def main(argv=None) -> DPOTrainer:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model name or directory (default: a tiny Llama from a config)")
    p.add_argument("--strategy", default="auto", help="bigfit's strategy: auto, single, ddp, zero2, zero3, zero2-offload, ...")
    p.add_argument("--output-dir", default="out/trl_dpo")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args(argv)
    model, tokenizer = model_and_tokenizer(a.model)
    reference = None if a.model else copy.deepcopy(model)  # a named model: DPOTrainer loads its own reference
    args = DPOConfig(output_dir=a.output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     max_steps=a.max_steps, learning_rate=1e-4, warmup_steps=2, logging_steps=1, max_length=64,
                     save_steps=max(1, a.max_steps // 2), bf16=a.bf16, report_to=[],
                     use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=triples(), processing_class=tokenizer)
    bigfit.hf.use(trainer, strategy=a.strategy)  # bigfit
    trainer.train()
    trainer.save_model()  # a Hugging Face directory
    return trainer


if __name__ == "__main__":
    main()
