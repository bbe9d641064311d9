"""`bigfit plan --calibrate`: measure this machine's cost of issuing an eager training step, per forward
operator with its backward (machine/hardware.py Hardware.host_op_us, used by planning/hostcost.py), and
its host Adam step's speed per optimizer-state format (offload/adamrate.py), then keep them in the cache
(machine/calibration.py) for `bigfit plan` and `--strategy auto` on this machine. The issuing cost is
measured on a small Llama-style model at one short sample, whose kernels take the GPU far less time than
the host needs to issue them, so a step's wall time is the host's; the operators are counted by the
planner's own trace (planning/profile.py), so the figure is in the unit the planner multiplies. Above
the planner and the offload engine: it runs a model step and the host Adam kernel."""
from __future__ import annotations

import datetime
import time

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, LlamaConfig

from ..engine.compiling import apply_compile
from ..machine import calibration as kept_figures
from ..models.source import is_seq2seq
from ..offload import adamrate
from ..planning.profile import profile_model

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=384, max_position_embeddings=64)
SEQ, STEPS, WARMUP = 16, 30, 5


def measure(device: torch.device, config=None, seq: int = SEQ, steps: int = STEPS, compile: bool = False) -> dict:
    """Seconds per forward-and-backward of the small model (or of `config`, benchmarks/host_issue.py), over
    the traced forward operators, and the forward's share of them: autograd issues each GPU's backward
    from a thread of its own, so a device map's GPUs issue their backwards at once but their forwards in
    turn (planning/device_map_row.py). On a GPU under bf16 autocast with fp32 weights (as `single` trains), on a
    CPU in fp32; `compile`: each block compiled as `--compile` does (hostcost.COMPILED's measure)."""
    gpu = device.type == "cuda"
    config = config or LlamaConfig(**CONFIG)
    seq2seq = is_seq2seq(config)
    # the plain trace's operators, which the planner multiplies (search.py): autocast's casts run
    # inside the dispatcher, so their cost is in the figure per operator, not counted apart
    ops = profile_model(config, 1, seq, seq if seq2seq else 0, "bf16" if gpu else "fp32", device.type)
    count = sum(ops.block_ops) + ops.other_ops
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model = auto.from_config(config).to(device).train()
    if compile:
        apply_compile(model)
    ids = torch.randint(0, config.vocab_size, (1, seq), device=device)
    batch = dict(input_ids=ids, labels=ids) if seq2seq else dict(input_ids=ids, use_cache=False)
    autocast = torch.autocast("cuda", torch.bfloat16) if gpu else torch.autocast("cpu", enabled=False)
    forward = 0.0
    for i in range(WARMUP + steps):
        if i == WARMUP:
            _sync(gpu)
            start = time.perf_counter()
        begun = time.perf_counter()
        with autocast:
            logits = model(**batch).logits
        forward += (time.perf_counter() - begun) * (i >= WARMUP)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
        model.zero_grad(set_to_none=True)
    _sync(gpu)
    step = (time.perf_counter() - start) / steps
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    return {"compiled": compile, "host_op_us": step / count * 1e6, "forward_share": forward / steps / step, "step_s": step,
            "operators": count, "device": name, "torch": torch.__version__,
            "measured": datetime.datetime.now().isoformat(timespec="seconds")}


def _sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


def calibrate() -> dict:
    """Measure on this machine's GPU (else its CPU) and keep the figures; returns the record: the
    host's cost per operator issued, and its Adam step's parameters a second (offload/adamrate.py) for the
    jobs on that device, whose host it is, and "not_kept": why the cache could not keep them (None
    where it did; this process plans with them either way)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = {**measure(device), "host_adam": adamrate.rates()}
    kept = kept_figures.read_cache()
    kept[device.type] = record
    if device.type == "cpu":  # its cores are the job's devices: their rates afresh too
        kept[kept_figures.CPU_RATES] = kept_figures.measure_cpu()
    return {**record, "not_kept": kept_figures.write_cache(kept)}
