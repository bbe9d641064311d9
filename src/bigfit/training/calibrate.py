"""Predicted against measured peak memory of one training configuration, on this process's device:
the GPU's max_memory_allocated, or on a CPU the growth of peak RSS (VmHWM, reset via clear_refs).
tests/test_planning.py runs it on the CPU; benchmarks/plan_accuracy.py on the GPU machine. Above the
planner (it trains), beside the loop."""
from __future__ import annotations

import gc

import torch
from transformers import AutoModelForCausalLM

from ..common.distributed import Runtime
from ..common.precision import DTYPES
from ..engine import build_optimizer
from ..job.resolution import resolve
from ..layout.mesh import with_mesh
from ..machine.hardware import Hardware
from ..parallel.apply import apply
from ..planning.estimate import memory
from ..planning.profile import profile_model
from ..settings.config import TrainConfig
from .step import train_step


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _start(gpu: bool) -> int:
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:  # peak RSS starts again from the current RSS
        f.write("5")
    return _status("VmRSS")


def _peak(gpu: bool) -> int:
    return torch.cuda.max_memory_allocated() if gpu else _status("VmHWM")


def measure(model_config, strategy: str, batch: int, seq: int, precision: str, rt: Runtime, steps: int = 2) -> dict:
    """Per-rank predicted bytes (by part) and the measured peak over building, sharding and `steps`
    training steps of `batch` (global) random sequences of `seq` tokens. Decoder-only models."""
    micro = batch // rt.world_size
    prof = profile_model(model_config, micro, seq, 0, precision, rt.device.type,
                         autocast=strategy in ("single", "ddp", "zero1"))
    predicted, _ = memory(strategy, prof, Hardware(gpu_bytes=(10**15,) * rt.world_size), DTYPES[precision].itemsize,
                          checkpointing=False, backend="gloo" if rt.device.type == "cpu" else "nccl")
    ids = torch.randint(0, model_config.vocab_size, (micro, seq), generator=torch.Generator().manual_seed(rt.rank))
    samples = [{"input_ids": x, "labels": x} for x in ids.tolist()]
    gpu = rt.device.type == "cuda"
    base = _start(gpu)
    model = AutoModelForCausalLM.from_config(model_config)
    job = resolve(TrainConfig(strategy=strategy, batch_size=batch, precision=precision), rt.world_size)
    cfg, plan = job.cfg, job.plan
    engine = apply(model, plan, cfg, with_mesh(rt, plan))
    build_optimizer(engine, cfg)
    for _ in range(steps):
        train_step(engine, [samples], pad_id=0, seq2seq=False, rt=rt, lr=1e-4, max_grad_norm=1.0)
    measured = _peak(gpu) - base
    del model, engine
    return {"strategy": strategy, "batch": batch, "seq": seq, "rank": rt.rank, "predicted": predicted["total"],
            "measured": measured, "ratio": predicted["total"] / measured, "parts": predicted}
