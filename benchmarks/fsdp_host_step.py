"""zero3-offload's host step in isolation: torch's fused AdamW over FSDP2's offloaded DTensor shards
(CPUOffloadPolicy, one unit per block and the root, as data_parallel/sharding.py shards) against the same
optimizer over plain tensors of the same sizes, and over one flat tensor, on this machine's cores.

    python benchmarks/fsdp_host_step.py [--hidden 1024 --layers 8 --vocab 32000] [--steps 5]

One process on gloo, no GPU: it asks whether FSDP2's DTensors slow the step itself, apart from the
copies and the clipping around it on a GPU machine. Median of `--steps` after 2 untimed, in G
parameters a second.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def rate(params: list[torch.nn.Parameter], steps: int) -> float:
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    times = []
    for i in range(steps + 2):
        began = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - began)
    return sum(p.numel() for p in params) / statistics.median(times) / 1e9


def with_grads(params):
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 256), intermediate_size=4 * args.hidden,
                      vocab_size=args.vocab, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    rows = {"plain tensors": rate(with_grads(list(model.parameters())), args.steps)}
    flat = torch.nn.Parameter(torch.randn(n))
    rows["one flat tensor"] = rate(with_grads([flat]), args.steps)
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    sharded = list(model.parameters())
    for p in sharded:
        p.grad = torch.distributed.tensor.DTensor.from_local(torch.randn_like(p.to_local()) * 1e-3, p.device_mesh,
                                                            p.placements)
    rows["FSDP2 offloaded DTensors"] = rate(sharded, args.steps)
    print(f"{n / 1e6:.0f}M parameters, {torch.get_num_threads()} threads: fused AdamW, G parameters/s")
    for name, r in rows.items():
        print(f"  {name:26} {r:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
