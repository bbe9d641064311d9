"""Per-strategy memory and step time, from a ModelProfile, the hardware and the job. Pure arithmetic;
each term names the engine behaviour it stands for (see data_parallel/sharding.py for the engines).

Notation: N parameters, W GPUs in all, g per node, c bytes of the compute dtype (2 for bf16/fp16,
4 for fp32), U the largest block's parameters (one FSDP unit), R the parameters outside blocks.
With LoRA (adapters.py) T of the N train, t of U and r of R: gradients, optimizer states, gradient
buckets and the traffic of gradients and updated parameters count those; parameters, gathers and
activations count everything. Without LoRA T = N, t = U, r = R.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..settings.config import STATE_BYTES
from . import quantized
from .devicecost import matmul_flops_per_s

KEYS = ("params", "grads", "optimizer", "activations", "buffers")
RESERVE = 1 << 30  # per GPU: CUDA context and allocator slack the plan never hands out
# of each GPU's budget: micro-batch auto's prediction stops short of it (and so does the job's size
# under torchrun, which is not probed). Filled closer, a step runs only by flushing the caching
# allocator's blocks, or not at all: T5-large's bench rows on an H100 (2026-12-06) settled, by probe,
# at sizes the plan puts at 92-99% of the budget (median 95%), and zero2-offload's step at 192 samples
# (100%) took twice as long a sample as at 160.
CACHE_SLACK = 0.05
# Host-memory bytes a parameter that the offload engine's host step moves, by gradient size: torch's
# fused AdamW reads master, gradient and moments, writes them back (the gradient too, unscaled), and
# the DMA writes fp32 gradients and reads masters (40); bigfit's kernel reads bf16 gradients and
# leaves them (32). hw.cpu_adam_params_per_s is torch's rate; the step is memory-bound (RESULTS.md).
HOST_STEP_BYTES = {4: 40, 2: 32}


def host_step_bytes(grad_bytes: int, states: str = "fp32") -> float:
    """Host-memory bytes a parameter of the offload engine's step: HOST_STEP_BYTES for fp32 moments;
    compact ones (offload/statefmt.py, bigfit's kernel only) read and write the master (8), their
    moments (twice their bytes), read the gradient after the DMA wrote it, and the DMA reads the
    master (4). Rated by bytes, as memory-bound: on the CPU machine's 2 cores, which compute rather
    than wait, the int8 kernel ran at 0.58-0.66 of the fp32 one's parameters a second and the bf16 one
    at 0.96-1.08 (benchmarks/host_adam.py, 2026-12-05): `bigfit plan --calibrate` measures a host's
    rate per format, which `host_adam_rate` then takes instead."""
    if states == "fp32":
        return HOST_STEP_BYTES[grad_bytes]
    return 12 + 2 * (STATE_BYTES[states] - 4) + 2 * grad_bytes


# bigfit's kernel per format against its fp32 step on a 16-core host where that step is bound by memory
# (benchmarks/host_adam.py, 268M parameters, bf16 gradients, the H100 machine, 2026-12-05: fp32 5.86,
# bf16 7.10, int8 4.50 G parameters/s): the compact formats compute more a byte (bf16's stochastic
# rounding, int8's codes), so their bytes alone overrate them, bf16 by 10% and int8 by 2x. The 10.9B
# under zero2-offload with bf16 states on the H200 machine stepped its host in 1.90 s (--delayed-update,
# 2026-12-05): 5.7 G/s, where its bytes said 6.7 and this says 6.1.
FORMAT_SPEED = {"fp32": 1.0, "bf16": 7.10 / 5.86, "int8": 4.50 / 5.86}


def host_adam_rate(hw, grad_bytes: int, states: str = "fp32") -> float:
    """Parameters a second of the offload engine's host step on one node: bigfit's kernel at this
    format's measured rate (hw.host_adam_rates, measured with bf16 gradients; fp32 ones cost their
    bytes more), else its fp32 step rated by its bytes against torch's fused step
    (hw.cpu_adam_params_per_s, 40 bytes a parameter) times the format's FORMAT_SPEED; slower still
    where torch's step stands in for the kernel."""
    measured = dict(hw.host_adam_rates)
    if hw.cpu_adam_kernel and states in measured:
        return measured[states] * host_step_bytes(2, states) / host_step_bytes(grad_bytes, states)
    if not hw.cpu_adam_kernel:
        return hw.cpu_adam_params_per_s * HOST_STEP_BYTES[4] / host_step_bytes(grad_bytes, states) * TORCH_ENGINE_ADAM
    fp32 = hw.cpu_adam_params_per_s * HOST_STEP_BYTES[4] / host_step_bytes(2)  # the kernel's, bf16 gradients
    return fp32 * FORMAT_SPEED[states] * host_step_bytes(2, states) / host_step_bytes(grad_bytes, states)


# zero3-offload's host step (FSDP2's CPUOffloadPolicy: torch's AdamW on each unit's host shards, with
# the clipping norm over host gradients) against hw.cpu_adam_params_per_s: 1.2-1.4 G parameters/s on
# the H200 machine's 16 cores at 1.5B and 1.2B (tests/data/h200_measured.json s1, k2, ss3), a third.
FSDP_HOST_ADAM = 0.35
# The offload engine's host step with torch's fused AdamW (no C compiler for bigfit's kernel, or
# BIGFIT_CPU_ADAM=0) against the bytes alone: 3.6B and 1.5B Llama at 4 x 2048 on the H200 machine
# (2026-12-04, tests/data/h200_measured.json o4-*torchadam*) took 16-27% longer than the bytes predict, in
# every mode (after backward with clipping, during backward, delayed, gradients on the device).
TORCH_ENGINE_ADAM = 0.8


@dataclass
class Estimate:
    name: str
    per_gpu: dict[str, int]
    per_host: dict[str, int]
    step_time_s: float
    costs: dict[str, float]  # seconds per step of compute, communication, pcie, cpu_optimizer, nvme
    nvme: float = 0.0  # bytes of optimizer files per node (zero2-offload-nvme)
    states: str = "fp32"  # the offload engine's moments' format (zero2-offload rows)
    why_states: str = ""  # why a compact format: what fp32 states would not fit
    labels: dict[str, str] = field(default_factory=dict)  # a cost's name as shown, where it says more (device_map)
    activations: str = "keep"  # how the row keeps its activations: keep, checkpoint or offload (keeping.py)
    checkpoint_blocks: int | None = None  # checkpoint / offload: the first blocks of each stack (None: all)

    @property
    def bottleneck(self) -> str:
        worst = max(self.costs, key=self.costs.get)
        return self.labels.get(worst, worst)


def grad_bytes(precision: str, kernel: bool) -> int:
    """A gradient value's bytes as it waits for the offload engine's host step: 2 where it travels in
    bf16 (bf16 compute and bigfit's host Adam kernel, cpu_adam.py), else 4."""
    return 2 if precision == "bf16" and kernel else 4


def _bytes(**kw) -> dict[str, int]:
    out = {k: int(kw.get(k, 0)) for k in KEYS}
    out["total"] = sum(out.values())
    return out


def memory(strategy: str, prof, hw, c: int, checkpointing: bool, accum: int = 1, backend: str = "nccl",
           grads_on_device: bool = False, nvme_host: float = 0.0, grad_bytes: int = 4,
           shards: int | None = None, four_bit: bool = False, delayed: bool = False,
           states: str = "fp32", blocks: list[bool] | None = None, offload: bool = False) -> tuple[dict, dict]:
    """(per-GPU bytes, per-host bytes) for one rank's GPU and one node's host RAM (`_memory`), the
    activations kept as `checkpointing`, `blocks` (which blocks are checkpointed; None: all) and
    `offload` (their inputs in pinned host RAM, every rank's of the node: profile.activations) say."""
    gpu, host = _memory(strategy, prof, hw, c, checkpointing, accum, backend, grads_on_device, nvme_host, grad_bytes,
                        shards, four_bit, delayed, states, blocks, offload)
    if checkpointing and offload:
        offloaded = prof.offloaded(blocks) * hw.gpus_per_node  # every rank's of the node
        host = _bytes(**{**{k: host[k] for k in KEYS}, "activations": host["activations"] + offloaded})
    return gpu, host


def _memory(strategy: str, prof, hw, c: int, checkpointing: bool, accum: int, backend: str, grads_on_device: bool,
            nvme_host: float, grad_bytes: int, shards: int | None, four_bit: bool, delayed: bool, states: str,
            blocks: list[bool] | None, offload: bool) -> tuple[dict, dict]:
    """(per-GPU bytes, per-host bytes) for one rank's GPU and one node's host RAM.

    The GPU figure is the step's peak: the largest of three moments, each counted with what is alive
    then (read off allocator traces of real steps on the CPU and on an H200: docs/planning.md).
    - loss: from the end of forward into the loss's backward. Every activation, and three fp32
      logits-sized tensors: the logits and their fp32 copy beside the saved log-softmax, then the
      gradients of the log-softmax's output and input beside it.
    - head: the backward of the output head, which comes first. Activations (less the loss's), the
      logits' gradient and the head's weight gradient; ZeRO-3 gathers the root group again here and
      prefetches the last block.
    - update: the end of backward and the optimizer step. Every gradient, no activations; under
      FSDP2 the root group's reduce-scatter, the last and, with large embeddings, the largest.
    Gradients live from backward to the optimizer's zero_grad(set_to_none): with one micro-batch per
    step (`accum` 1) there are none at the loss; with accumulation the earlier micro-batches' are held.
    `backend` "gloo" adds the copies gloo's reduce-scatter makes (CPU runs, the tests). The host
    always holds rank 0's full fp32 model while it is sharded (a transient, counted under buffers).
    zero2-offload: `grads_on_device` (offload_grads device) keeps the gradients on the GPU until the
    host step (gradslots.py), with `delayed` (--delayed-update) through the next step's forward too, as
    the host steps on them meanwhile; `nvme_host` is the node's bytes of optimizer states kept in RAM (nvme);
    `grad_bytes` is the size of a gradient value while it waits: 2 where it travels in bf16 (bf16
    compute and bigfit's host Adam kernel, cpu_adam.py), else 4; `states` the moments' format
    (config.STATE_BYTES: with the fp32 master 12, 8 or about 6 bytes a parameter). `shards`: the data-parallel ranks the
    states are divided over, when not every GPU (composed layouts: dp_shard; layouts.py). `four_bit`:
    the LoRA base layers in 4 bits, one of them dequantized at a time (quantized.py); under FSDP2 this
    rank's rows of them, gathered in 4 bits, on the host with zero3-offload."""
    n, w, u, r, v = prof.params, shards or hw.world_size, prof.largest_unit_params, prof.root_params, prof.head_params
    t, ut, rt, vt = prof.trainable_params, prof.largest_trainable_unit, prof.root_trainable, prof.trainable_head
    act = prof.activations(checkpointing, blocks, offload)
    loss_act = act - prof.loss_saved
    lc, l32 = prof.logits_bytes, (prof.logits_numel or prof.logits_bytes // c) * 4
    held = 1 if accum > 1 else 0
    init = 0 if four_bit else 4 * n  # a 4-bit base is read and quantized on the device, a layer at a time
    if strategy in ("single", "ddp", "zero1"):  # autocast: fp32 weights, compute-dtype copies saved for backward
        optim = 8 * t / w if strategy == "zero1" and w > 1 else 8 * t
        fixed = 4 * t if strategy != "single" and w > 1 else 0  # DDP's gradient buckets, allocated throughout
        # a frozen (LoRA) base is stored in the compute dtype (parallel/apply.py store_frozen): nothing
        # to cast but the adapters, all of them linear layers
        copies = c * min(prof.matmul_params or n, t) if c < 4 else 0
        head_grad = (4 + c) * vt if c < 4 else 4 * vt  # in the compute dtype, then accumulated in fp32
        frozen, dequant = _frozen_whole(strategy, prof, hw, c, four_bit)
        copies += dequant
        return _peak(dict(params=4 * t + frozen, grads=4 * t * held, optimizer=optim),
                     loss=dict(activations=act, buffers=fixed + copies + 2 * l32),
                     head=dict(activations=loss_act, buffers=fixed + copies + lc + head_grad),
                     update=dict(grads=4 * t, buffers=fixed)), _bytes(buffers=init)
    q, uq = (prof.quantized_params, prof.unit_quantized) if four_bit else (0, 0)
    # fp32 master shards of what trains; a frozen (LoRA) base in the compute dtype, as FSDP2 gathers it
    # (parallel/apply.py store_frozen), and the 4-bit base's rows; FSDP2 pads each parameter to a
    # multiple of W (ignored)
    shard = (4 * t + c * (n - t - q)) / w + (quantized.shard_bytes(prof, w) if four_bit else 0)
    tshard = 4 * t / w
    g = hw.gpus_per_node
    if strategy.startswith("zero2-offload"):  # the offload engine (offload/engine.py)
        bucket = (c + 4 + 4 / w) * max(ut, vt)  # a bucket's gradients, packed in fp32, reduce-scattered
        rows = grad_bytes * t / w  # this rank's reduced gradient rows, as they wait for the host step
        waiting = dict(update=dict(grads=4 * t * held + rows, buffers=bucket)) if grads_on_device else {}
        # the last step's rows wait on the device through this step's forward (3.6B Llama on the H200,
        # 2026-12-04: 6.3 GB over the same job stepping after backward, 12.5 GB with fp32 rows)
        late = rows if grads_on_device and delayed else 0
        # compute-dtype parameters (frozen ones too: placement.place_frozen; a 4-bit base in NF4, one layer
        # dequantized at a time); fp32 accumulators
        frozen, dequant = _frozen_whole(strategy, prof, hw, c, four_bit)
        gpu = _peak(dict(params=c * t + frozen, grads=4 * t * held + late),
                    loss=dict(activations=act, buffers=2 * l32 + dequant),
                    head=dict(activations=loss_act, buffers=lc + bucket + dequant), **waiting)
        # the gradients' rows, or three slots of the largest bucket
        slots = (3 * max(ut, vt) / w if grads_on_device else t / w) * grad_bytes * g
        states_bytes = STATE_BYTES[states] * t / w * g
        optim = min(nvme_host, states_bytes) if strategy.endswith("nvme") else states_bytes
        # rank 0's fp32 copy is not on top of the states: placing the model swaps each parameter's
        # host data for the device copy (placement._put) before the moments are allocated (attach)
        return gpu, _bytes(grads=slots, optimizer=optim, buffers=max(0.0, init - slots - optim))
    # FSDP2: zero2 keeps every unit gathered from its forward to its backward. zero3 reshards each
    # after its forward (the root too) and gathers it again for backward: an all-gather's output and
    # the unsharded copy made from it (gloo: and its own copy of the output) exist together. A 4-bit
    # base is gathered as NF4 (the root holds none: no adapter wraps embeddings or head), and each
    # matmul dequantizes its layer beside it, in forward and backward.
    if strategy == "zero2":
        forward = quantized.with_base(c, n, q)
        head = forward + c * v
    else:
        forward, head = 0, max(2 * c * r, c * r + c * v + 2 * quantized.with_base(c, u, uq))
    dequant = quantized.transient(prof, "torchao") if four_bit else 0
    # the root group's reduce-scatter, at the end of backward: its unsharded gradients copied into the
    # fp32 input, then the output (this rank's gradient shard); the previous unit's input is kept till then
    reduce = 4 * rt + max(c * rt, 4 * rt / w)
    if backend == "gloo":  # gloo copies the input, and its averaging the output
        reduce = max(reduce, 8 * rt + 8 * rt / w)
    if strategy == "zero3-offload":  # shards, gradients and optimizer states in host RAM
        host = _bytes(params=shard * g, grads=tshard * g, optimizer=2 * tshard * g, buffers=init)
        return _peak({}, loss=dict(activations=act, buffers=2 * l32 + dequant),
                     head=dict(activations=loss_act, buffers=lc + head + dequant),
                     update=dict(buffers=4 * ut + reduce)), host
    return _peak(dict(params=shard, grads=tshard * held, optimizer=2 * tshard),
                 loss=dict(activations=act, buffers=forward + 2 * l32 + dequant),
                 head=dict(activations=loss_act, buffers=lc + head + dequant),
                 update=dict(grads=tshard, buffers=4 * ut + reduce - 4 * rt / w)), _bytes(buffers=init)


def _frozen_whole(strategy: str, prof, hw, c: int, four_bit: bool) -> tuple[float, float]:
    """(bytes, dequantisation temporaries) of a frozen (LoRA) base that each process holds whole in the
    compute dtype (store_frozen, placement.place_frozen), its base layers in NF4 under `four_bit`, one
    of them dequantized at a time in forward and backward."""
    if not four_bit:
        return c * prof.frozen_params, 0.0
    return quantized.frozen_bytes(prof, c), quantized.transient(prof, quantized.store(strategy, hw))


def _peak(common: dict, **moments: dict) -> dict[str, int]:
    """The moment with the most bytes alive, each moment being `common` updated by its own parts."""
    return max((_bytes(**{**common, **parts}) for parts in moments.values()), key=lambda m: m["total"])


def step_time(strategy: str, prof, hw, c: int, checkpointing: float, tokens_per_step: int, accum: int,
              nvme_host: float = 0.0, grad_bytes: int = 4, issue: float = 0.0, traffic: float = 0.0,
              states: str = "fp32", four_bit: bool = False, precision: str = "bf16",
              offloaded: float = 0.0) -> dict:
    """Seconds per optimizer step of each cost; the step is their overlapped combination. `checkpointing`:
    the share of the blocks' FLOPs recomputed (True: all; each a third of its FLOPs again); `issue`: the
    host's seconds to issue the step's kernels (hostcost.py), a floor under the GPU's compute;
    `traffic`: the GPU's seconds of memory-bound operators (devicecost.py), on top of its FLOPs.
    `four_bit`: FSDP2 gathers the LoRA base layers, and zero3-offload copies their shards up, in NF4.
    `offloaded`: a step's bytes of block inputs --activations offload copies to the host and back on a
    side stream, overlapped with compute (`combine`)."""
    n, t, w = prof.params, prof.trainable_params, hw.world_size
    q = prof.quantized_params if four_bit else 0
    flops = prof.flops_per_token * tokens_per_step * (1 + checkpointing / 3)
    compute = flops / (w * matmul_flops_per_s(hw, precision)) + traffic
    link = (hw.inter_gbps / hw.gpus_per_node if hw.nodes > 1 else hw.intra_gbps) * 1e9
    ring = (w - 1) / w
    # gradients and updated parameters move for the trainable parameters alone; all-gathers move every one
    if w == 1 or strategy == "single":
        comm = 0.0
    elif strategy in ("ddp", "zero1"):  # one all-reduce of fp32 gradients (+ zero1's parameter broadcast)
        comm = (2 * 4 * t + (4 * t if strategy == "zero1" else 0)) * ring / link
    elif strategy.startswith("zero2-offload"):  # the engine: once per step, after local accumulation
        comm = (4 * t + c * t) * ring / link
    else:  # per micro-batch: gather parameters (twice for zero3), reduce-scatter fp32 gradients
        gathers = 1 if strategy.startswith("zero2") else 2
        comm = accum * (gathers * quantized.with_base(c, n, q) + 4 * t) * ring / link
    pcie = cpu = disk = 0.0
    if "offload" in strategy:
        moved = (grad_bytes + 4) * t / w  # gradient rows down, fp32 master rows up (zero2-offload: once per step)
        if strategy == "zero3-offload":
            # shards up for forward and backward, gradients down
            moved = accum * 2 * (4 * t + quantized.with_base(c, n - t, q)) / w + 4 * t / w
        pcie = moved / (hw.pcie_gbps * 1e9)
        if strategy.startswith("zero2-offload"):  # the node's ranks share its cores
            cpu = t / w * hw.gpus_per_node / host_adam_rate(hw, grad_bytes, states)
        else:  # torch's AdamW over FSDP2's host shards, at its measured share of the fused step's rate
            cpu = t / w * hw.gpus_per_node / (hw.cpu_adam_params_per_s * FSDP_HOST_ADAM)
    if strategy.endswith("nvme"):  # read and write back every state on the disk, the node's ranks together
        disk = 2 * nvme_bytes(t, hw, nvme_host, states) / (hw.nvme_gbps * 1e9)
    out = {"compute": compute, "host issue": issue, "communication": comm, "pcie": pcie, "cpu_optimizer": cpu,
           "nvme": disk}
    if offloaded:
        out["activation offload"] = activation_copies(offloaded, hw)
    return out


def activation_copies(offloaded: float, hw) -> float:
    """Seconds of one GPU's PCIe copies of `offloaded` bytes of block inputs a step: to the host in
    forward, back before backward (2 x the bytes at hw.pcie_gbps). They run on a side stream beside the
    blocks' compute, so `combine` takes the larger of the two, not their sum."""
    return 2 * offloaded / (hw.pcie_gbps * 1e9)


# The process beside its offloaded states: CUDA context, libraries, the dataset (plain PyTorch's process
# was 1.4 GiB on the H200 machine, the offload engine's 1.6 GiB over its states: docs/planning.md), with room.
PROCESS_BYTES = 4 * 10**9


def nvme_fill(prof, hw, grads_on_device: bool, grad_bytes: int, states: str = "fp32") -> float:
    """One node's bytes of optimizer states zero2-offload-nvme keeps in RAM when the planner chooses
    (`--strategy auto` with no --nvme-host-gb): what 90% of the RAM leaves beside the gradients'
    slots (memory()'s) and the process, at most every state."""
    t, w, g = prof.trainable_params, hw.world_size, hw.gpus_per_node
    bucket = max(prof.largest_trainable_unit, prof.trainable_head)
    slots = (3 * bucket / w if grads_on_device else t / w) * grad_bytes * g
    return max(0.0, min(STATE_BYTES[states] * t / w * g, 0.9 * hw.cpu_ram - slots - PROCESS_BYTES))


def nvme_bytes(n: float, hw, nvme_host: float = 0.0, states: str = "fp32") -> float:
    """One node's optimizer files under zero2-offload-nvme for n trainable parameters: fp32 master
    weights and two moments in `states`' format, less the `nvme_host` bytes kept in RAM."""
    return max(0.0, STATE_BYTES[states] * n / hw.world_size * hw.gpus_per_node - nvme_host)


def combine(costs: dict, engine: str | None = None, accum: int = 1, device: str = "cuda") -> float:
    """One step from its costs. The GPU computes no faster than the host issues its kernels, and its
    work overlaps communication (FSDP2 prefetches, DDP buckets). On CPU devices (`device`) one set of
    cores issues, computes, runs gloo's collectives and the offload engine's host step: they add up. The
    NVMe reads of the next bucket overlap the host step of the current one, and the host-device
    copies overlap the host step and backward. zero3-offload's host step (FSDP2's) follows the GPU
    work. The offload engine's (`engine`, offload/engine.py) overlaps some GPU work:
    - "after-backward": the next step's first forward (f, a third of a micro-batch) runs behind it;
    - "eager": it runs under the last backward (b, two thirds of a micro-batch), but the first block
      it needs for the next forward is the last it updates;
    - "delayed": the whole next step runs beside it.
    Under the first two the host step's threads and the issuing of the pass beside it share the host's
    cores: that pass's issue time adds to the host's side (the H200's rows of both modes, 24 of them,
    moved from a median error of -7% to 0%, 7% to 4% in absolute terms; host-bound ones from -6..-11%
    to within 5%). Not under "delayed", where it made 10 of 17 rows 7-22 points slower than measured."""
    if device == "cpu":
        gpu = costs["compute"] + costs.get("host issue", 0.0) + costs["communication"]
        gpu += costs.get("activation offload", 0.0)
        return gpu + costs["pcie"] + max(costs["cpu_optimizer"], costs["nvme"])
    # --activations offload's copies run on a side stream under the blocks' compute (activation_copies)
    work = max(costs["compute"], costs.get("host issue", 0.0), costs.get("activation offload", 0.0))
    gpu = max(work, costs["communication"])
    host = max(costs["cpu_optimizer"], costs["nvme"], costs["pcie"])
    if engine is None:
        return gpu + costs["pcie"] + max(costs["cpu_optimizer"], costs["nvme"])
    f, issued = work / accum / 3, costs.get("host issue", 0.0) / accum / 3
    if engine == "delayed":
        return max(gpu, host)
    if engine == "eager":
        return gpu - 2 * f + max(2 * f, host + 2 * issued)
    return gpu - f + max(f, host + issued)
