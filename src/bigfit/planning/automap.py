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

from dataclasses import dataclass, replace

import torch

from ..common.precision import DTYPES
from ..errors import BigfitError
from ..layout.maps import canonical_device, check_device, name_stacks, resolve_map
from ..machine.hardware import parse_size
from ..models.source import block_lists
from .adapters import frozen_costs
from .balance import balance, loads, size
from .estimate import RESERVE
from .workload import Workload
from .profile import as_compiled, profile_model


@dataclass
class Costs:
    """Predicted bytes of the job by kind (planning.estimate.KEYS: params, grads, optimizer,
    activations, buffers), per block and for the main device; the balancer sees their totals."""
    parts: list[dict[str, int]]  # each block's bytes by kind, in execution order
    main_parts: dict[str, int]  # on the main device outside blocks
    per_device: int  # activation bytes once on every device with a block (checkpointed recompute)
    boundaries: list[int]  # positions where a new stack starts

    @property
    def blocks(self) -> list[int]:
        return [sum(p.values()) for p in self.parts]

    @property
    def main(self) -> int:
        return sum(self.main_parts.values())


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

    seq2seq = getattr(config, "is_encoder_decoder", False)
    return Workload(batch_size=8, seq_len=512, target_len=128 if seq2seq else 0, precision="fp32")


def costs(model: torch.nn.Module, found, job) -> Costs:
    """Per-block and main-device bytes for training `model` (real or on the meta device) on `job`."""
    config = getattr(model, "config", None)
    if config is None:
        raise BigfitError(f"device_map='auto' traces the model's activations from its Hugging Face config; "
                          f"{type(model).__name__} has none: give an explicit map")
    if [p for p, _ in block_lists(model)] != [s.path for s, _ in found]:
        raise BigfitError("device_map='auto' works on the stacks bigfit finds itself; with stacks=... give a map")
    # parameters counted on the model itself: it may not be the Auto class the trace builds from its config
    params = [sum(p.numel() for p in blk.parameters()) for _, stack in found for blk in stack]
    root = sum(p.numel() for p in model.parameters()) - sum(params)
    return profile_costs(profile_for(config, job), job, params, root, [s.size for s, _ in found])


def profile_for(config, job):
    """The model traced as one process trains it: the whole micro-batch (no data-parallel split), under
    autocast over fp32 weights as device maps and pipeline stages run it (a CUDA bf16/fp16 job: T5's
    residual stream then stays in fp32), its blocks compiled where the job compiles them. Its operators
    are the plain trace's, the unit `bigfit plan --calibrate` prices (machine/calibration.py): autocast's casts
    run inside the dispatcher, and the host's cost of them is in the price of the others."""
    lengths = (config, job.micro(1), job.seq_len, job.target_len or job.seq_len, job.precision)
    traced = profile_model(*lengths, autocast=True, lora=job.lora)
    plain = profile_model(*lengths, lora=job.lora)
    return as_compiled(replace(traced, block_ops=plain.block_ops, other_ops=plain.other_ops), job.compile)


def state_bytes(n: int, c: int) -> dict[str, int]:
    """What training keeps for n parameters: fp32 weights, gradients, AdamW's two moments, and under
    bf16/fp16 autocast's compute-dtype copy of the weights (a buffer)."""
    return {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "buffers": c * n if c < 4 else 0}


def profile_costs(prof, job, params=None, root=None, sizes=None) -> Costs:
    """Costs from a ModelProfile alone (pure): its blocks' parameters and stacks unless given."""
    params = prof.block_params if params is None else params
    root = prof.root_params if root is None else root
    sizes = [n for _, n in prof.stacks] if sizes is None else sizes
    c = DTYPES[job.precision].itemsize
    saved, again = prof.block_saved, job.checkpointed(prof.stacks, prof.n_blocks)
    if job.checkpointing:  # checkpointed blocks keep their inputs
        saved = [i if on else a for i, a, on in zip(prof.block_inputs, prof.block_saved, again)]
    parts = [{**state_bytes(n, c), "activations": a} for n, a in zip(params, saved)]
    main = {**state_bytes(root, c), "activations": prof.other_saved}
    main["buffers"] += prof.logits_bytes // c * (4 + c) if c < 4 else prof.logits_bytes  # the logits' gradient
    bounds = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
    return frozen_costs(Costs(parts=parts, main_parts=main, boundaries=bounds,
                              per_device=max((a for a, on in zip(prof.block_saved, again) if on), default=0)
                              if job.checkpointing else 0), prof, job)


def assign(stacks, cost: Costs, budgets: list[tuple[str, int]], main=None) -> tuple[dict, list[str], str]:
    """(the map in its user form, the device of each block in execution order, the main device)."""
    main = canonical_device(main) if main is not None else None
    devices = balance(cost.blocks, budgets, main_bytes=cost.main, main=main, per_device_bytes=cost.per_device,
                      boundaries=cost.boundaries)
    main = main or budgets[0][0]
    spec: dict = {"main_device": main}
    at = 0
    for s in stacks:
        per: dict[str, list[int]] = {}
        for i in range(s.size):
            per.setdefault(devices[at + i], []).append(i)
        spec[s.name] = per
        at += s.size
    return spec, devices, main


def device_parts(assignment: list[str], cost: Costs, main: str, chunks: int = 1) -> dict[str, dict[str, int]]:
    """Predicted bytes by kind on each device of an assignment at that device's peak (`_peak_moment`),
    with `chunks` GPipe chunks (None or 1: none). The balancer fits the sum of every kind
    (balance.loads), which this never exceeds."""
    out: dict[str, dict[str, int]] = {}
    for kind in cost.main_parts:
        per = loads(assignment, [p[kind] for p in cost.parts], main, cost.main_parts[kind],
                    cost.per_device if kind == "activations" else 0)
        for dev, b in per.items():
            out.setdefault(dev, {})[kind] = b
    for dev, parts in out.items():
        mine = [p for p, d in zip(cost.parts, assignment) if d == dev]
        parts["grads"], parts["activations"] = _peak_moment(mine, parts, chunks or 1)
    return out


def _peak_moment(blocks: list[dict[str, int]], total: dict[str, int], chunks: int) -> tuple[int, int]:
    """(gradients, activations) alive on a device at its peak. Gradients are set to None after each
    step, so none of a device's blocks has one until backward reaches it, and each block's saved
    activations are freed as its gradients are made: walking the device's blocks in backward order,
    the peak is the largest sum of the activations not yet used and the gradients already made, or
    the optimizer's step (every gradient, no activation). GPipe holds every chunk's activations, and
    backward's first chunk through the device makes every gradient while it frees 1/chunks of them
    (one autograd call runs a device's nodes latest first). What the device holds outside its blocks
    (the main device's head and embeddings, a recompute's block) counts throughout. Measured on the
    H200 machine (tests/data/h200_measured.json): T5-large's maps over cuda:0 + cpu at batch 8-128
    came to within 1.2% of this where the sum of every kind read 4-18% over."""
    grads = [b["grads"] for b in blocks][::-1]
    acts = [b["activations"] for b in blocks][::-1]
    fixed_g, fixed_a = total["grads"] - sum(grads), total["activations"] - sum(acts)
    made, left, best = 0, sum(acts), (0, sum(acts))
    for g, a in zip(grads, acts):
        made, left = made + g, left - a // chunks
        if made + left > sum(best):
            best = (made, left)
    return fixed_g + best[0], fixed_a + best[1]


def auto_map(model, found, budgets, job=None, main=None) -> dict:
    """The balanced map (user form) for `model` under `budgets` ({device: size}) and a planning Job."""
    parsed = parse_budgets(budgets)
    return assign([s for s, _ in found], costs(model, found, job or default_job(model.config)), parsed, main)[0]


def plan_budgets(hw) -> list[tuple[str, int]]:
    """One node of a planned machine as budgets: each GPU less the planner's reserve, then 90% of
    host RAM as the overflow. A GPU no larger than the reserve holds nothing."""

    gpus = [(f"cuda:{i}", b - RESERVE) for i, b in enumerate(hw.gpu_bytes) if b > RESERVE]
    return gpus + [("cpu", int(hw.cpu_ram * 0.9))]


def plan_map(config, budgets: list[tuple[str, int]], job) -> dict:
    """What `bigfit plan` shows: the map auto would choose for `config`, and each device's peak."""
    return split_plan(profile_for(config, job), budgets, job)


def split_plan(prof, budgets: list[tuple[str, int]], job) -> dict:
    """The map auto would choose from a ModelProfile (pure): the map, the device of each block
    ("assignment"), each device's predicted bytes (total and by kind) against its budget; or, when
    no map fits, "map" None and the balancer's reason."""
    stacks = name_stacks(prof.stacks)
    cost = profile_costs(prof, job)
    try:
        spec, assignment, main = assign(stacks, cost, budgets)
    except BigfitError as e:
        return {"map": None, "why_not": str(e), "budgets": dict(budgets)}
    parts = device_parts(assignment, cost, main, job.chunks)
    caps = dict(budgets)
    dmap = resolve_map(spec, tuple(stacks), check_devices=False)
    return {"map": spec, "describe": dmap.describe(), "assignment": assignment, "main": main,
            "devices": {d: {"predicted_bytes": sum(p.values()), "budget_bytes": caps[d], "parts": p}
                        for d, p in parts.items()},
            "text": ", ".join(f"{d} {size(sum(p.values()))} of {size(caps[d])}" for d, p in parts.items())}
