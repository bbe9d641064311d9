"""device_map as a row of the plan: one process drives every GPU of one node, host RAM as the overflow,
with the blocks placed by the same balancer `--device-map auto` uses (planning/automap.py). Pure, from
a ModelProfile traced at the one process's whole micro-batch (nothing is divided over ranks).

Memory: the balancer fits each device's blocks' fp32 weights, gradients, AdamW moments, autocast's
compute-dtype copy and saved activations all at once (the main device adds the non-block parameters,
what is saved outside blocks and the logits' gradient); the plan's `device_map` section shows every
device at its peak moment, when its gradients and activations are not all alive together
(planning.automap.device_parts). The row's per-GPU figure is the GPU holding the most. Time
(docs/planning.md): the devices take turns, so a step is the sum of each device's compute, plus the
copies at each change of device, plus the host's AdamW for parameters mapped to `cpu`; with GPipe
chunks the slowest stage sets the pace; the one host computes its own blocks and issues every GPU's
kernels in turn. With LoRA a frozen parameter has no gradient and no moments (adapters.frozen_costs)
and the host steps its adapters alone; with a 4-bit base (QLoRA) each device keeps its layers in NF4
and dequantizes them every pass.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .automap import device_parts, plan_budgets, profile_costs, split_plan
from .devicecost import matmul_flops_per_s, traffic_seconds
from .estimate import Estimate, _bytes
from .hostcost import FORWARD_SHARE, HOOK_S, pass_seconds
from .keeping import recompute_share
from .quantized import dequant_seconds

NAME = "device_map"
# Host seconds per parameter of a block mapped to the host, each pass (micro-batch or chunk) whatever its
# size: autocast's bf16 copy of every fp32 weight, backward's read of it and the gradient's accumulation
# into fp32 sweep the weights (about 18 bytes a parameter, memory-bound in torch's CPU kernels). Fitted
# with hardware.DEFAULTS' cpu_tflops on T5-large's maps over cuda:0 + cpu on the H200 machine (the rows
# of 2026-11-29 and 2026-12-01 in tests/data/h200_measured.json, batch 8-128, 1-4 chunks): a flat map
# at batch 8 took 1.6 s unchunked and 3.5 s in 4 chunks, which FLOPs alone rate alike.
HOST_SWEEP_S = 1.5e-9


@dataclass
class SplitRow:
    estimate: Estimate
    section: dict  # what the plan shows as its device map (planning.automap.split_plan), with the chunks
    no_fit: str | None  # why no map fits the devices' budgets (the balancer's words)
    not_candidate: str | None  # why it cannot be recommended although it fits (no split, several nodes)


def budgets(hw) -> list[tuple[str, int]]:
    """The devices one process drives: the user's budgets where given (hw.map_budgets), else each GPU
    of one node, then host RAM; a CPU machine is one device."""
    if hw.map_budgets:
        return list(hw.map_budgets)
    return [("cpu", int(hw.cpu_ram * 0.9))] if hw.device == "cpu" else plan_budgets(hw)


def device_map_row(prof, hw, job) -> SplitRow:
    chunks = job.chunks or 1  # None: the default, no GPipe
    section = {**split_plan(prof, budgets(hw), job), "chunks": chunks}
    if section["map"] is None:  # nothing fits: show the whole job on the first device, and its time there
        main, cost = budgets(hw)[0][0], profile_costs(prof, job)
        assignment = [main] * len(cost.parts)
        parts = device_parts(assignment, cost, main, chunks)
    else:
        main, assignment = section["main"], section["assignment"]
        parts = {d: v["parts"] for d, v in section["devices"].items()}
    # the per-GPU column: the GPU holding the most (host RAM is shown as host); budgets differ per device
    gpus = {d: p for d, p in parts.items() if not d.startswith("cpu")} or parts
    shown = max(gpus, key=lambda d: sum(gpus[d].values()))
    section["shown"] = shown
    costs, stage = map_costs(prof, hw, job, assignment, main)
    e = Estimate(NAME, _bytes(**parts[shown]), _host(prof, job, parts.get("cpu")), sum(costs.values()), costs,
                 labels={"compute": _label(stage, chunks, hw.gpus_per_node)})
    return SplitRow(e, section, section.get("why_not"), _no_split(set(stage), hw, e))


def map_costs(prof, hw, job, assignment: list[str], main: str) -> tuple[dict[str, float], dict[str, float]]:
    """A map's step by cost (compute, copies, the host's AdamW) and each device's compute (`stage_seconds`).
    One host computes its own blocks and issues every GPU's kernels: the step is at least the sum of
    the two, chunks or not."""
    chunks = job.chunks or 1
    passes = max(1, job.batch_size // job.micro(1)) * chunks
    stage = stage_seconds(prof, hw, job, assignment, main, passes)
    issued = passes * _issue_per_pass(prof, hw, job, assignment, main, chunks)
    host = sum(t for d, t in stage.items() if d.startswith("cpu"))
    costs = {"compute": max(_compute(stage, chunks), host + issued), "copies": _copies(prof, hw, job, assignment, main),
             "cpu_optimizer": _host_params(prof, assignment, main) / hw.cpu_adam_params_per_s}
    return costs, stage


def _issue_per_pass(prof, hw, job, assignment: list[str], main: str, chunks: int) -> float:
    """Host seconds to issue one pass's GPU kernels with the map's hooks. One thread runs every forward;
    autograd gives each GPU a thread of its own for backward, so with chunks (the GPUs then work at once)
    the GPUs' backwards are issued side by side (hostcost.FORWARD_SHARE); unchunked they take turns."""
    gpus = {d for d in [*assignment, main] if not d.startswith("cpu")}
    each = {d: pass_seconds(prof, hw, job, [g for g, x in enumerate(assignment) if x == d], outside=d == main)
            for d in gpus}
    hooks = sum(1 for d in assignment if not d.startswith("cpu")) * HOOK_S
    if chunks == 1 or len(each) < 2:
        return sum(each.values()) + hooks
    return FORWARD_SHARE * sum(each.values()) + (1 - FORWARD_SHARE) * max(each.values()) + hooks


def stage_seconds(prof, hw, job, assignment: list[str], main: str, passes: int,
                  host_per_pass: float = 0.0) -> dict[str, float]:
    """Each device's compute per step: its blocks' model FLOPs (`block_flops`); the main device adds the
    non-embedding rest (an untied head) on the output tokens. GPUs at MFU of their peak plus their blocks'
    memory-bound operators (devicecost.py), but no faster than the host issues their kernels for `passes`
    micro-batches or chunks a step (hostcost.py), with `host_per_pass` more host seconds each (a
    pipeline schedule's); the host at cpu_tflops plus its weights' sweeps. On a machine without GPUs
    one set of cores issues and computes: the issue time adds, and the host's blocks add their
    memory-bound operators at the whole machine's bandwidth (its "devices" are shares of it)."""
    flops = {main: prof.outside_flops_per_token() * (job.target_len or job.seq_len)}
    for dev, f in zip(assignment, block_flops(prof, job)):
        flops[dev] = flops.get(dev, 0.0) + f
    recompute = 1 + recompute_share(prof, job) / 3  # the checkpointed blocks' forward again (4/3 where all are)
    out = {d: f * job.batch_size * recompute / _flops_per_s(d, hw, job.precision) for d, f in flops.items()}
    for d in out:
        mine = [g for g, dev in enumerate(assignment) if dev == d]
        if d.startswith("cpu"):  # the host's own blocks: their FLOPs and weights' sweeps (HOST_SWEEP_S was fitted
            # with their operators' dispatch inside), at least that dispatch: what bounds small blocks, as on
            # a machine without GPUs, which maps every block here
            out[d] += passes * max(recompute * sum(prof.block_params[g] for g in mine) * HOST_SWEEP_S,
                                   pass_seconds(prof, hw, job, mine, outside=d == main))
            if hw.device == "cpu":
                whole = replace(hw, gpu_mem_gbps=hw.gpu_mem_gbps * hw.world_size)
                out[d] += traffic_seconds(prof, whole, job, mine, d == main, job.batch_size)
            continue
        out[d] += traffic_seconds(prof, hw, job, mine, d == main, job.batch_size)
        if job.load_in_4bit:  # its 4-bit layers dequantized by bitsandbytes, each pass
            out[d] += dequant_seconds(prof, hw, job, passes, params=sum(prof.block_quantized[g] for g in mine))
        issued = passes * (pass_seconds(prof, hw, job, mine, outside=d == main) + host_per_pass)
        out[d] = out[d] + issued if hw.device == "cpu" else max(out[d], issued)
    return out


def block_flops(prof, job) -> list[float]:
    """Each block's model FLOPs per sample (profile._block_flops: an encoder-decoder's encoder blocks on
    the source tokens, its decoder blocks on the target's). A profile built by hand without them: 6 x
    each block's parameters and an equal share of the attention term, on every token of the sample."""
    if prof.block_matmul_flops:
        return [m + a for m, a in zip(prof.block_matmul_flops, prof.block_attention_flops)]
    attn = (prof.flops_per_token - 6 * (prof.params - prof.embedding_params)) / max(prof.n_blocks, 1)
    return [(6 * n + attn) * (job.seq_len + job.target_len) for n in prof.block_params]


def _flops_per_s(device: str, hw, precision: str) -> float:
    return hw.cpu_tflops * 1e12 if device.startswith("cpu") else matmul_flops_per_s(hw, precision)


def _compute(stage: dict[str, float], chunks: int) -> float:
    """One device works at a time: the sum. GPipe over N chunks: the slowest device's N chunk-times and
    each other device's one as the clock fills and drains, (N - 1) x the slowest chunk-time + the sum of
    every device's; for p equal stages the (N + p - 1) clocks of a balanced pipeline. T5-large flat over
    cuda:0 + cpu at batch 16 in 2 chunks took 2.90 s, about the host's two chunks: the balanced clock's
    slowest-stage x (N + p - 1) / N said 4.30."""
    if chunks == 1:
        return sum(stage.values())
    per_chunk = [t / chunks for t in stage.values()]
    return (chunks - 1) * max(per_chunk) + sum(per_chunk)


def _copies(prof, hw, job, assignment: list[str], main: str) -> float:
    """Seconds of copies at each change of device along the forward: a block's floating-point inputs
    (the hidden state, with the masks, position bias or encoder output that go with it) and, in
    backward, as many bytes of gradients back; each stack's output returns to the main device. Over
    PCIe when the host is one end, else GPU to GPU. Per micro-batch (accumulation repeats them)."""
    accum = max(1, job.batch_size // job.micro(1))
    path, at = [(main, 0)], 0
    for _, size in prof.stacks:
        path += [(assignment[i], prof.block_inputs[i]) for i in range(at, at + size)]
        path.append((main, prof.block_inputs[at + size - 1]))  # the hidden state is as large as the last input
        at += size
    seconds = 0.0
    for (a, _), (b, nbytes) in zip(path, path[1:]):
        if a != b:
            gbps = hw.pcie_gbps if "cpu" in (a[:3], b[:3]) else hw.intra_gbps
            seconds += 2 * nbytes * accum / (gbps * 1e9)
    return seconds


def _host_params(prof, assignment: list[str], main: str) -> float:
    """Parameters the host's AdamW steps: the trainable ones of blocks (and of the non-block parts)
    mapped to the host."""
    trainable = [n - f for n, f in zip(prof.block_params, prof.blocks_frozen())]
    on_host = sum(n for d, n in zip(assignment, trainable) if d.startswith("cpu"))
    return on_host + (prof.root_trainable if main.startswith("cpu") else 0)


def _host(prof, job, cpu_parts: dict | None) -> dict[str, int]:
    """One node's RAM: the larger of the fp32 model built there before its blocks move (4N, as every row
    counts it; a 4-bit base is made on its devices instead) and what the map keeps on the host while
    training."""
    built = _bytes(buffers=0 if job.load_in_4bit else 4 * prof.params)
    return max(built, _bytes(**(cpu_parts or {})), key=lambda b: b["total"])


def _label(stage: dict[str, float], chunks: int, gpus: int) -> str:
    p, slowest = len(stage), max(stage, key=stage.get)
    if p == 1:  # the whole job on one device: the node's other GPUs do nothing
        return f"compute ({slowest}" + (f"; {gpus - 1} GPU(s) unused)" if gpus > 1 else ")")
    how = f"{p - 1} of {p} devices idle" if chunks == 1 else f"GPipe, {chunks} chunks, {p} stages"
    return ("host compute" if slowest.startswith("cpu") else "compute") + f" ({how})"


def _no_split(used: set[str], hw, e: Estimate) -> str | None:
    """On one GPU, a map onto that GPU alone is the single strategy with hooks; on several, the largest
    GPU alone can still be the one place the job fits, so it stays a candidate."""
    if len(used) == 1 and hw.world_size == 1:
        return (f"no split: {next(iter(used))} alone holds the job ({e.per_gpu['total'] / 1e9:.1f} GB); "
                "single runs it without device-map hooks")
    if hw.nodes > 1:
        return f"one process on one node: the other {hw.nodes - 1} node(s) would sit idle (ddp and zero* span nodes)"
    return None
