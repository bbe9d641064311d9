"""t5-3b's model-state memory on one node of 8 GPUs: bigfit's plan next to DeepSpeed's published
estimators (estimate_zero2_model_states_mem_needs / estimate_zero3_..., their formulas restated
here; DeepSpeed itself is not needed). Prints a markdown table for docs/planning.md.

  python benchmarks/t5_3b_estimates.py
"""
from __future__ import annotations

from transformers import T5Config

from bigfit.machine.hardware import Hardware
from bigfit.planning.estimate import memory
from bigfit.planning.profile import profile_model

GPUS, BUF = 8, 1.5  # DeepSpeed's additional_buffer_factor


def deepspeed(n: int, largest_layer: int) -> dict[str, tuple[float, float]]:
    """(per GPU, per CPU) bytes as DeepSpeed's estimators compute them (zero_init for stage 3)."""
    ll = 4 * largest_layer
    return {"zero2": (4 * n + 16 * n / GPUS, n * 4 * GPUS * BUF),
            "zero2-offload": (2 * n, n * max(4 * GPUS, 16) * BUF),
            "zero3": (ll + 18 * n / GPUS, largest_layer * 4 * GPUS * BUF),
            "zero3-offload": (ll, n * 18 * BUF)}


def main() -> None:
    cfg = T5Config(d_model=1024, d_ff=16384, d_kv=128, num_heads=32, num_layers=24, vocab_size=32128)
    prof = profile_model(cfg, 1, 8, 8, "bf16")
    largest = cfg.vocab_size * cfg.d_model  # DeepSpeed's "largest layer": the shared embedding
    hw = Hardware(gpu_bytes=(16 * 10**9,) * GPUS, cpu_ram=512 * 10**9)
    print(f"t5-3b: {prof.params:,} parameters; 1 node x {GPUS} GPUs; bf16; GB = 10^9 bytes\n")
    print("| strategy | bigfit GPU states | bigfit GPU gathered + reduce buffers | bigfit host | DeepSpeed GPU | DeepSpeed CPU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (ds_gpu, ds_cpu) in deepspeed(prof.params, largest).items():
        gpu, host = memory(name, prof, hw, 2, checkpointing=True)
        states = gpu["params"] + gpu["grads"] + gpu["optimizer"]
        gathered = gpu["buffers"] - prof.logits_bytes // 2 * 6  # parameters gathered for compute, no loss temporaries
        print(f"| {name} | {states / 1e9:.2f} | {gathered / 1e9:.2f} | {host['total'] / 1e9:.1f} | "
              f"{ds_gpu / 1e9:.2f} | {ds_cpu / 1e9:.1f} |")


if __name__ == "__main__":
    main()
