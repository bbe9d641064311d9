"""`bigfit plan --calibrate`: this machine's cost of issuing an eager training step, per forward
operator with its backward (hardware.Hardware.host_op_us, used by planning/hostcost.py). Measured on a
small Llama-style model at one short sample, whose kernels take the GPU far less time than the host
needs to issue them, so a step's wall time is the host's; the operators are counted by the planner's
own trace (profile.py), so the figure is in the unit the planner multiplies. Kept per device type in
the cache (hardware.calibration_path) for `bigfit plan` and `--strategy auto` on this machine."""
from __future__ import annotations

import datetime
import json
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from .hardware import calibration_path
from .planning.profile import profile_model

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=384, max_position_embeddings=64)
SEQ, STEPS, WARMUP = 16, 30, 5


def measure(device: torch.device) -> dict:
    """Seconds per forward-and-backward of the small model, over the traced forward operators. On a GPU
    under bf16 autocast with fp32 weights (as `single` trains), on a CPU in fp32."""
    gpu = device.type == "cuda"
    config = LlamaConfig(**CONFIG)
    ops = profile_model(config, 1, SEQ, 0, "bf16" if gpu else "fp32", device.type, autocast=gpu)
    count = sum(ops.block_ops) + ops.other_ops
    model = AutoModelForCausalLM.from_config(config).to(device).train()
    ids = torch.randint(0, config.vocab_size, (1, SEQ), device=device)
    autocast = torch.autocast("cuda", torch.bfloat16) if gpu else torch.autocast("cpu", enabled=False)
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            _sync(gpu)
            start = time.perf_counter()
        with autocast:
            logits = model(input_ids=ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
        model.zero_grad(set_to_none=True)
    _sync(gpu)
    step = (time.perf_counter() - start) / STEPS
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    return {"host_op_us": step / count * 1e6, "step_s": step, "operators": count, "device": name,
            "torch": torch.__version__, "measured": datetime.datetime.now().isoformat(timespec="seconds")}


def _sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


def calibrate() -> dict:
    """Measure on this machine's GPU (else its CPU) and keep the figure; returns the record."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = measure(device)
    path = calibration_path()
    kept = {}
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        pass  # first calibration, or an unreadable file: written afresh
    kept[device.type] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(kept, indent=1))
    tmp.replace(path)
    return record
