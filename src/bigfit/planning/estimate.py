"""Per-strategy memory and step time, from a ModelProfile, the hardware and the job. Pure arithmetic;
each term names the engine behaviour it stands for (see strategies/sharding.py for the engines).

Notation: N parameters, W GPUs in all, g per node, c bytes of the compute dtype (2 for bf16/fp16,
4 for fp32), U the largest block's parameters (one FSDP unit), R the parameters outside blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

KEYS = ("params", "grads", "optimizer", "activations", "buffers")
MFU = 0.48  # fraction of peak a dense training step reached on the H200 (plain PyTorch, 1.5B, bf16)
RESERVE = 1 << 30  # per GPU: CUDA context and allocator slack the plan never hands out


@dataclass
class Estimate:
    name: str
    per_gpu: dict[str, int]
    per_host: dict[str, int]
    step_time_s: float
    costs: dict[str, float]  # seconds per step of compute, communication, pcie, cpu_optimizer, nvme
    nvme: float = 0.0  # bytes of optimizer files per node (zero2-offload-nvme)

    @property
    def bottleneck(self) -> str:
        return max(self.costs, key=self.costs.get)


def _bytes(**kw) -> dict[str, int]:
    out = {k: int(kw.get(k, 0)) for k in KEYS}
    out["total"] = sum(out.values())
    return out


def memory(strategy: str, prof, hw, c: int, checkpointing: bool) -> tuple[dict, dict]:
    """(per-GPU bytes, per-host bytes) for one rank's GPU and one node's host RAM. The host always
    holds rank 0's full fp32 model while it is sharded (a transient, counted under buffers)."""
    n, w, u, r = prof.params, hw.world_size, prof.largest_unit_params, prof.root_params
    init = 4 * n
    act = prof.activations(checkpointing)
    # the loss's gradient w.r.t. the fp32 logits, plus its cast back to the compute dtype (none in fp32,
    # where .float() is the same tensor)
    logits_grad = prof.logits_bytes // c * (4 + c) if c < 4 else prof.logits_bytes
    mixed = c < 4
    if strategy in ("single", "ddp", "zero1"):  # autocast: fp32 weights, bf16 copies saved for backward
        optim = 8 * n / w if strategy == "zero1" and w > 1 else 8 * n
        gpu = _bytes(params=4 * n, grads=4 * n, optimizer=optim, activations=act,
                     buffers=logits_grad + (c * n if mixed else 0))
        return gpu, _bytes(buffers=init)
    shard = 4 * n / w  # fp32 master shard, FSDP2 pads each parameter to a multiple of W (ignored)
    gathered = c * n if strategy.startswith("zero2") else c * (r + 2 * u)  # zero2 holds all; zero3 two units
    buffers = gathered + 4 * u + logits_grad  # + the unsharded fp32 gradients of the unit being reduced
    if strategy in ("zero2", "zero3"):
        return _bytes(params=shard, grads=shard, optimizer=2 * shard, activations=act, buffers=buffers), _bytes(buffers=init)
    g = hw.gpus_per_node
    on_disk = strategy.endswith("nvme")  # master weights and moments in files (nvme_bytes)
    host = _bytes(params=shard * g if strategy == "zero3-offload" else 0,
                  grads=shard * g,  # host gradient copies
                  optimizer=0 if on_disk else (2 * shard + (shard if strategy == "zero2-offload" else 0)) * g,
                  buffers=init)
    if strategy.startswith("zero2-offload"):
        return _bytes(params=shard, grads=shard, activations=act, buffers=buffers), host
    return _bytes(activations=act, buffers=buffers), host  # zero3-offload


def step_time(strategy: str, prof, hw, c: int, checkpointing: bool, tokens_per_step: int, accum: int) -> dict:
    """Seconds per optimizer step of each cost; the step is their overlapped combination."""
    n, w = prof.params, hw.world_size
    flops = prof.flops_per_token * tokens_per_step * (4 / 3 if checkpointing else 1)
    compute = flops / (w * hw.gpu_tflops * 1e12 * MFU)
    link = (hw.inter_gbps / hw.gpus_per_node if hw.nodes > 1 else hw.intra_gbps) * 1e9
    ring = (w - 1) / w
    if w == 1 or strategy == "single":
        comm = 0.0
    elif strategy in ("ddp", "zero1"):  # one all-reduce of fp32 gradients (+ zero1's parameter broadcast)
        comm = (2 * 4 * n + (4 * n if strategy == "zero1" else 0)) * ring / link
    else:  # per micro-batch: gather parameters (twice for zero3), reduce-scatter fp32 gradients
        gathers = 1 if strategy.startswith("zero2") else 2
        comm = accum * (gathers * c * n + 4 * n) * ring / link
    pcie = cpu = disk = 0.0
    if "offload" in strategy:
        moved = 2 * 4 * n / w  # gradients down, parameters up (zero2-offload: once per step)
        if strategy == "zero3-offload":
            moved = accum * 2 * 4 * n / w + 4 * n / w  # shards up for forward and backward, gradients down
        pcie = moved / (hw.pcie_gbps * 1e9)
        cpu = n / w * hw.gpus_per_node / hw.cpu_adam_params_per_s  # the node's ranks share its cores
    if strategy.endswith("nvme"):  # read and write back 12 bytes per parameter, the node's ranks together
        disk = 2 * nvme_bytes(n, hw) / (hw.nvme_gbps * 1e9)
    return {"compute": compute, "communication": comm, "pcie": pcie, "cpu_optimizer": cpu, "nvme": disk}


def nvme_bytes(n: int, hw) -> float:
    """One node's optimizer files under zero2-offload-nvme: fp32 master weights and two moments."""
    return 12 * n / hw.world_size * hw.gpus_per_node


def combine(costs: dict) -> float:
    """GPU work overlaps communication (FSDP2 prefetches, DDP buckets); the host step and its copies
    do not overlap in the current offload path, so they add; the NVMe reads of the next bucket overlap
    the host step of the current one."""
    return (max(costs["compute"], costs["communication"]) + costs["pcie"]
            + max(costs["cpu_optimizer"], costs["nvme"]))
