"""`bigfit plan`'s LoRA flags, declared without loading torch or the planner: cli.py builds every
parser at each start, and planning.command (read by `lora_from_args` there) takes seconds to import."""
from __future__ import annotations

from ..config import TrainConfig

LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")


def add_lora_flags(p, number=lambda base: base) -> None:
    """`bigfit plan --lora [--lora-r N --lora-alpha A --lora-dropout D --lora-targets T] [--load-in-4bit]`:
    the job trains LoRA adapters (bigfit train --lora, with its defaults), the base frozen, in 4 bits
    with --load-in-4bit (QLoRA, planning/quantized.py: the single, ddp, zero2, zero3 and zero3-offload
    rows). `number(int)`, `number(float)`: the parser's converters (cli.py's `_number` words errors as
    for its other flags).
    The values default to None, so that a value given without --lora can be refused."""
    d = TrainConfig
    p.add_argument("--lora", action="store_true", help="plan a LoRA fine-tuning: adapters train, the base is frozen")
    p.add_argument("--lora-r", type=number(int), help=f"--lora: the adapters' rank (default {d.lora_r})")
    p.add_argument("--lora-alpha", type=number(float),
                   help=f"--lora: the adapters' scale is alpha / r (default {d.lora_alpha:g})")
    p.add_argument("--lora-dropout", type=number(float),
                   help=f"--lora: dropout on the adapters' input (default {d.lora_dropout:g})")
    p.add_argument("--lora-targets",
                   help=f"--lora: {d.lora_targets} (default) or linear layer names, like q_proj,v_proj")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="--lora: the frozen base layers in 4 bits (QLoRA: NF4, double quantisation, bf16 compute); "
                        "rates single, ddp, zero2, zero3 and zero3-offload, the strategies that run it")
