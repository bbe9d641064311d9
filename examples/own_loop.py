"""A training loop of your own on bigfit's engines: your model, your data, your loss.

Here (no GPU, no downloads) it trains a tiny Llama built from a config on made-up token data, in
seconds; the same script trains a real model on GPUs:

    python examples/own_loop.py                                   # one process (here: the CPU)
    python examples/own_loop.py --model meta-llama/Llama-3.2-1B --strategy zero2-offload --steps 200
    torchrun --nproc-per-node 8 examples/own_loop.py --model ./my-llama --strategy zero3
    accelerate launch --num_processes 8 examples/own_loop.py --model ./my-llama --strategy zero3
    srun python examples/own_loop.py ...                          # in an sbatch job (docs/recipes.md)

`--strategy auto` lets bigfit's planner pick the fastest plan that fits, rated on one batch of yours.
The loss is yours: here next-token cross-entropy with a z-loss on the logits (PaLM's), which bigfit
train's own loop does not have.
"""
from __future__ import annotations

import argparse

import torch

import bigfit


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def my_loss(logits: torch.Tensor, labels: torch.Tensor, z_weight: float = 1e-4) -> torch.Tensor:
    """Next-token cross-entropy plus z-loss (the squared log-partition function), in fp32."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return ce + z_weight * torch.logsumexp(logits, dim=-1).pow(2).mean()


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face model directory or hub name (default: a tiny Llama)")
    p.add_argument("--strategy", default="single", help="bigfit's strategy: single, ddp, zero2, zero3, zero2-offload, auto, ...")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4, help="samples per process per step")
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args(argv)

    model = tiny_llama() if args.model is None else args.model  # a path: each rank loads only its part
    vocab = 512 if args.model is None else None
    sample = None
    if args.strategy == "auto":  # the planner rates one batch as the loop feeds it
        ids = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
        sample = {"input_ids": ids, "labels": ids}
    engine = bigfit.prepare(model, strategy=args.strategy, lr=1e-3, max_grad_norm=1.0, sample=sample)
    if engine.is_main:
        print("plan:", engine.plan["plan"], "|", "; ".join(engine.plan["applied"]) or "nothing else applied")
        print("prediction:", engine.plan["prediction"])
    vocab = vocab or engine.module.config.vocab_size
    # counting sequences (start, start + step, ...): made up, but learnable
    g = torch.Generator().manual_seed(0)
    start, stride = torch.randint(3, vocab, (256, 1), generator=g), torch.randint(1, 4, (256, 1), generator=g)
    data = 3 + (start + stride * torch.arange(args.seq_len)) % (vocab - 3)
    losses, step = [], 0
    while step < args.steps:
        for ids in engine.loader(torch.utils.data.TensorDataset(data), batch_size=args.batch_size):
            ids = ids[0].to(engine.device)
            loss = my_loss(engine.model(input_ids=ids).logits, ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            step += 1
            if engine.is_main:
                print(f"step {step}: loss {loss.item():.4f}, grad norm {engine.grad_norm:.3f}")
            if step == args.steps:
                break
    engine.close()
    return losses


if __name__ == "__main__":
    main()
