"""`device_map="auto"`: each block's predicted bytes for the job, from the planner, balanced over the
devices' budgets by balance.py.

A block costs what training keeps for it: fp32 weights, gradients and AdamW's two moments (16 bytes
a parameter, plus the compute-dtype copy autocast makes under bf16/fp16) and the activations autograd
saves inside it at the job's micro-batch and lengths (planning/profile.py traces them under fake
tensors; with activation checkpointing only its inputs, plus one block's recompute per device).
The main device also holds the non-block parameters, what is saved outside blocks and the logits'
gradient. With chunks, GPipe keeps every micro-batch's activations until backward, so the total is
that of the whole micro-batch, as counted here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import BigfitError
from ..hardware import parse_size
from ..models import block_lists
from ..precision import DTYPES
from .balance import balance, loads, size
from .maps import canonical_device, check_device


@dataclass
class Costs:
    blocks: list[int]  # bytes of each block, in execution order
    main: int  # bytes on the main device outside blocks
    per_device: int  # bytes once on every device with a block (checkpointed recompute)
    boundaries: list[int]  # positions where a new stack starts


def parse_budgets(budgets) -> list[tuple[str, int]]:
    """{"cuda:0": "8GB", "cpu": 64e9} -> [("cuda:0", 8e9), ("cpu", 64e9)], devices checked."""
    if not isinstance(budgets, dict) or not budgets:
        raise BigfitError("device_map='auto' needs budgets like {'cuda:0': '8GB', 'cuda:1': '24GB', 'cpu': '64GB'}")
    out: dict[str, int] = {}
    for dev, amount in budgets.items():
        d = canonical_device(dev)
        check_device(d)
        if d in out:
            raise BigfitError(f"device {d} has two budgets")
        out[d] = amount if isinstance(amount, int) else parse_size(str(amount), f"budget of {d}")
    return list(out.items())


def default_job(config):
    from ..planning.search import Job

    seq2seq = getattr(config, "is_encoder_decoder", False)
    return Job(batch_size=8, seq_len=512, target_len=128 if seq2seq else 0, precision="fp32")


def costs(model: torch.nn.Module, found, job) -> Costs:
    """Per-block and main-device bytes for training `model` (real or on the meta device) on `job`."""
    from ..planning.profile import profile_model

    config = getattr(model, "config", None)
    if config is None:
        raise BigfitError(f"device_map='auto' traces the model's activations from its Hugging Face config; "
                          f"{type(model).__name__} has none: give an explicit map")
    if [p for p, _ in block_lists(model)] != [s.path for s, _ in found]:
        raise BigfitError("device_map='auto' works on the stacks bigfit finds itself; with stacks=... give a map")
    micro = job.micro(1)
    prof = profile_model(config, micro, job.seq_len, job.target_len or job.seq_len, job.precision)
    c = DTYPES[job.precision].itemsize
    state = 16 + (c if c < 4 else 0)  # fp32 weight, gradient, two AdamW moments (+ autocast's copy)
    params = [sum(p.numel() for p in blk.parameters()) for _, stack in found for blk in stack]
    saved = prof.block_inputs if job.checkpointing else prof.block_saved
    blocks = [n * state + a for n, a in zip(params, saved)]
    root = sum(p.numel() for p in model.parameters()) - sum(params)
    logits_grad = prof.logits_bytes // c * (4 + c) if c < 4 else prof.logits_bytes
    bounds, at = [], 0
    for s, _ in found[:-1]:
        at += s.size
        bounds.append(at)
    return Costs(blocks=blocks, main=root * state + prof.other_saved + logits_grad,
                 per_device=max(prof.block_saved, default=0) if job.checkpointing else 0, boundaries=bounds)


def assign(found, cost: Costs, budgets: list[tuple[str, int]], main=None) -> tuple[dict, dict[str, int]]:
    """(the map in its user form, predicted bytes per device)."""
    main = canonical_device(main) if main is not None else None
    devices = balance(cost.blocks, budgets, main_bytes=cost.main, main=main, per_device_bytes=cost.per_device,
                      boundaries=cost.boundaries)
    main = main or budgets[0][0]
    spec: dict = {"main_device": main}
    at = 0
    for s, _ in found:
        per: dict[str, list[int]] = {}
        for i in range(s.size):
            per.setdefault(devices[at + i], []).append(i)
        spec[s.name] = per
        at += s.size
    return spec, loads(devices, cost.blocks, main, cost.main, cost.per_device)


def auto_map(model, found, budgets, job=None, main=None) -> dict:
    """The balanced map (user form) for `model` under `budgets` ({device: size}) and a planning Job."""
    parsed = parse_budgets(budgets)
    return assign(found, costs(model, found, job or default_job(model.config)), parsed, main)[0]


def plan_budgets(hw) -> list[tuple[str, int]]:
    """One node of a planned machine as budgets: each GPU less the planner's reserve, then 90% of
    host RAM as the overflow. A GPU no larger than the reserve holds nothing."""
    from ..planning.estimate import RESERVE

    gpus = [(f"cuda:{i}", b - RESERVE) for i, b in enumerate(hw.gpu_bytes) if b > RESERVE]
    return gpus + [("cpu", int(hw.cpu_ram * 0.9))]


def plan_map(config, budgets: list[tuple[str, int]], job) -> dict:
    """What `bigfit plan` shows: the map auto would choose, and each device's predicted peak."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from .hooks import find_stacks

    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    found = find_stacks(model)
    spec, per_device = assign(found, costs(model, found, job), budgets)
    from .maps import resolve_map

    dmap = resolve_map(spec, tuple(s for s, _ in found), check_devices=False)
    caps = dict(budgets)
    return {"map": spec, "describe": dmap.describe(),
            "devices": {d: {"predicted_bytes": b, "budget_bytes": caps[d]} for d, b in per_device.items()},
            "text": ", ".join(f"{d} {size(b)} of {size(caps[d])}" for d, b in per_device.items())}
