"""`apply`: the plan's transforms on an unmodified model, in their one order (torchtitan's):

    4-bit base -> split -> tensor parallel -> context parallel -> activation checkpointing -> compile -> sharding
    -> materialise -> offload

The model comes on the meta device on every rank (bigfit.loading): each transform cuts shapes, not
weights, and each rank then fills only what it stores, from its slices of the safetensors weights
or by the seeded init. On the rank-0 path (`.bin` weights, hub names not cached, device maps, a
model handed in with real weights) rank 0 brings the whole model and the others receive their parts.
- 4-bit base (QLoRA): each LoRA base layer read in bf16 and quantized on the device (adapters/quantize.py),
  before anything allocates the rest of the model, where each process holds all of it (single, ddp,
  zero1, the offload engine); under FSDP2 (zero2, zero3, zero3-offload) a unit's layers at a time,
  just before the sharding step shards that unit; with a device map or pipeline stages at the
  split, the layers this process keeps, each on its device.
- split: a device map (one process drives every device) or pipeline stages (this rank keeps its
  stages' blocks and fills them, or gets them from rank 0, and runs them through torch's
  schedules); first, because every later transform works on the blocks this rank keeps.
- tensor parallel: each kept block's matrices split over the mesh's `tp` ranks (DTensor); before
  checkpointing and compile, so that both see the parallel block.
- context parallel: bigfit's attention named in the model's config (context/), which gathers the
  sequence's keys and values over the mesh's `cp` ranks; before checkpointing, so that a block's
  recompute gathers them again rather than keeping them. The head's chunked loss (engine/chunkloss.py)
  is installed on the engine at the end: it reads the head the engine drives.
- activation checkpointing, then compile, of every kept block: inside the units FSDP2 makes next,
  so a block's parameters are gathered around its recompute.
- sharding over the data-parallel ranks: FSDP2 units (ZeRO-2/3, HSDP), DDP (+ ZeRO-1; its
  replicas filled first, since DDP broadcasts rank 0's values as it wraps), or DDP's gradient
  all-reduce on pipeline stages. zero2-offload's engine shards rows itself (offload step). Under
  autocast (single, ddp, zero1, device maps, stages) and FSDP2 a frozen LoRA base is stored in the
  compute dtype first.
- materialise: each rank allocates its shards (FSDP2's, tensor parallelism's; the whole model on
  one process) and fills them; on the rank-0 path they receive rank 0's, so the whole model exists
  only on rank 0.
- offload: the offload engine (optimizer states and update in host RAM or files; it places the
  parameters: whole on the device, this rank's fp32 rows on the host, read or made on each rank),
  or zero3-offload's host steps streamed under backward.
Each step is a no-op when its part of the plan is off; none returns early.
"""
from __future__ import annotations

import os

import torch

from ..adapters.quantize import UnitQuantizer, describe, is_quantized, quantize_base
from ..common.distributed import Runtime
from ..common.precision import DTYPES, compute_dtype
from ..data_parallel.sharding import apply_ddp, apply_fsdp
from ..data_parallel.streamed import stream_host_steps
from ..context import ContextParallel, apply_context_parallel
from ..device_map.strategy import apply_device_map
from ..engine.checkpointing import apply_activation_checkpointing
from ..engine.chunkloss import chunked_head
from ..engine.compiling import apply_compile
from ..engine.protocol import Applied
from ..errors import BigfitError
from ..layout.plan import ParallelPlan
from ..loading import Weights, WholeParams, fill, weights_for
from ..loading.materialise import materialise_from_rank0, to_device
from ..offload.strategy import apply_offload
from ..pipeline.strategy import apply_pipeline
from ..tensor import apply_tensor_parallel


def apply(model: torch.nn.Module, plan: ParallelPlan, cfg, rt: Runtime,
          lengths: tuple[int, int] | None = None) -> Applied:
    """Spread `model` as `plan` says. A meta-device model on every rank is filled per rank (weights
    from cfg.model's files, or the seeded init); otherwise rank 0 brings the real weights and the
    other ranks a meta-device model. Returns the engine the training loop drives (engine/protocol.py
    `Engine`). `lengths`: the data's longest sample (the job's), which `--device-map auto` balances
    for, as the planner rated it (else the length limits)."""
    weights = weights_for(model, cfg, rt)  # checks the files against the model, before any storage
    full = model.state_dict() if weights is None and rt.is_main and _materialises(plan, rt) else {}  # references
    quantized = apply_4bit(model, plan, cfg, rt, weights)
    split = apply_split(model, plan, cfg, rt, weights, lengths)
    notes = apply_tp(split.module, plan, rt)
    context = apply_context(split.module, plan, rt)
    notes += apply_per_block(split.module, plan, cfg)
    engine = apply_sharding(model, split, plan, cfg, rt, weights, quantized)
    engine = apply_materialise(engine, full, plan, rt, weights)
    engine = apply_offloading(engine, plan, cfg, rt, weights)
    engine.notes[:0] = notes + ([weights.describe()] if weights else []) + _described(quantized)
    engine.frozen_in_checkpoints = not cfg.lora  # a LoRA base is made again from its source on every start
    engine.context = context
    # not where the head runs apart from the micro-batch that set its targets: a pipeline's last stage (the
    # schedule's loss function), a device map's GPipe chunks (their segments run on the scheduler's thread)
    if plan.pp == 1 and not (plan.split and plan.chunks > 1):
        engine.chunked = chunked_head(engine.module, cfg.loss_chunk)
    if plan.sequence_parallel:  # torch 2.11 gathers uneven sequence splits into views its backward cannot use
        engine.sequence_multiple = plan.tp
    if plan.tp > 1:
        engine.counts = rt.mesh.get_local_rank("tp") == 0  # tensor-parallel peers repeat its losses and texts
        engine.norm_ranks = engine.norm_ranks or rt.world_size  # pipelines set their own
    return engine


def apply_4bit(model, plan: ParallelPlan, cfg, rt: Runtime, weights: Weights | None) -> UnitQuantizer | dict:
    """QLoRA: each LoRA base layer read and quantized to 4 bits on the device (adapters/quantize.py), before
    anything allocates the rest; on the per-rank path only (its weights come from `weights`). Under
    FSDP2 the quantizer the sharding step calls on each unit before it shards it; a device map or
    pipeline stages quantize at the split, once they know where each kept layer lives. Returns the
    quantizer, or the layers quantized by each store."""
    if not cfg.load_in_4bit:
        return {}
    if weights is None:
        raise BigfitError(f"--load-in-4bit reads the base from safetensors files or a config; --model "
                          f"{cfg.model!r} has neither (convert its .bin weights with save_pretrained, "
                          "safe_serialization=True)")
    if plan.split or plan.pp > 1:
        return {}
    if plan.engine == "fsdp":
        return UnitQuantizer(model, weights, rt.device, plan.dp_shard)
    return quantize_base(model, weights, lambda _: rt.device, torch.cuda.is_available())


def _described(quantized: UnitQuantizer | dict) -> list[str]:
    if isinstance(quantized, UnitQuantizer):
        return [describe({"torchao's NF4Tensor, sharded by FSDP2": quantized.done})]
    return [describe(quantized)] if quantized else []  # a split describes its own


def _materialises(plan: ParallelPlan, rt: Runtime) -> bool:
    """Weights reach the other ranks by broadcast after sharding: FSDP2 and tensor-parallel layouts.
    Pipelines send each rank its stages' tensors while splitting; DDP broadcasts on wrapping; the
    offload engine copies each rank's rows itself."""
    return rt.distributed and plan.pp == 1 and (plan.engine == "fsdp" or plan.tp > 1)


def apply_split(model, plan: ParallelPlan, cfg, rt: Runtime, weights: Weights | None = None,
                lengths: tuple[int, int] | None = None) -> Applied:
    """Device map or pipeline stages (filled here: later transforms cut their real tensors);
    otherwise the model whole, as a plain engine to build on."""
    if plan.split == "device_map":
        return apply_device_map(model, cfg, rt, weights, lengths)
    if plan.pp > 1:
        return apply_pipeline(model, plan, cfg, rt, weights)
    return Applied(model=model, module=model, strategy=plan.name)


def apply_tp(model, plan: ParallelPlan, rt: Runtime) -> list[str]:
    if plan.tp == 1:
        return []
    return apply_tensor_parallel(model, rt.mesh["tp"], plan.sequence_parallel)


def apply_context(model, plan: ParallelPlan, rt: Runtime) -> ContextParallel | None:
    if plan.cp == 1:
        return None
    return apply_context_parallel(model, rt.mesh["cp"])


def apply_per_block(model, plan: ParallelPlan, cfg) -> list[str]:
    """Activation checkpointing, then compile, of each block this rank keeps."""
    notes = []
    if plan.checkpointing:
        n = apply_activation_checkpointing(model, plan.checkpoint_blocks, plan.offload_activations)
        where = ", their inputs in host RAM" if plan.offload_activations else ""
        notes.append(f"activation checkpointing on {n} blocks{where}")
    if plan.compile:
        notes.append(f"torch.compile ({cfg.compile_backend}) on {apply_compile(model, cfg.compile_backend)} blocks")
    return notes


def apply_sharding(model, split: Applied, plan: ParallelPlan, cfg, rt: Runtime,
                   weights: Weights | None = None, quantizer=None) -> Applied:
    """The data-parallel engine over the `dp` ranks, or the split's own engine where it has one.
    `quantizer` (QLoRA under FSDP2: apply_4bit's) quantizes each unit's base before it is sharded."""
    compute = compute_dtype(cfg.precision)
    if plan.split or plan.pp > 1:  # a device map (one process) or pipeline stages
        if plan.engine != "offload":  # the offload engine places frozen weights itself (placement.py)
            store_frozen(model, compute)
        # the offload engine shards the stages' rows itself; zero3-offload needs FSDP2 even on one rank
        if (plan.dp > 1 or plan.offload_params) and plan.engine != "offload":
            return split.shard_stages(plan, rt, compute, DTYPES[cfg.reduce_dtype])
        return split
    if plan.engine == "fsdp":
        store_frozen(model, compute)  # FSDP2 casts every parameter to `compute` for its gathers: a frozen one can be so
        return apply_fsdp(model, plan, rt, compute, DTYPES[cfg.reduce_dtype],
                          before=quantizer if isinstance(quantizer, UnitQuantizer) else None)
    if plan.engine == "offload":
        return split  # the offload engine shards rows itself: it is built at the offload step
    store_frozen(model, compute)
    if plan.engine == "ddp":
        if weights is not None:
            fill(model, weights, rt.device)  # storage, then every replica reads the whole model itself
        else:
            to_device(model, rt.device)
        return apply_ddp(model, plan, rt, compute, cfg.ddp_bucket_mb)  # DDP broadcasts rank 0's weights
    to_device(model, rt.device)  # a meta model: storage only, filled next (materialise)
    return Applied(model=model, module=model, strategy=plan.name, autocast=compute)


def store_frozen(model, compute) -> None:
    """A frozen base under autocast (single, ddp, zero1, device maps and pipeline stages with --lora)
    or FSDP2's mixed precision: its weights stored in the compute dtype, as peft users load theirs.
    Autocast keeps fp32 weights as the optimizer's masters and FSDP2 fp32 shards, which frozen
    weights need not have: an 8B base takes 16 GB instead of 32, and each gather of it casts nothing
    (FSDP2 holds trainable parameters alone to one dtype). Before the weights are filled (meta) or
    after (the rank-0 path, a split's filled blocks): the values are the fp32 init's, rounded as the
    casts round them."""
    if compute is None:
        return
    frozen = (p for p in model.parameters() if not p.requires_grad and p.is_floating_point() and not is_quantized(p))
    for p in {id(p): p for p in frozen}.values():  # an NF4 weight's dtype is bf16's: its bytes stay
        p.data = p.data.to(compute)


def apply_materialise(engine: Applied, full: dict, plan: ParallelPlan, rt: Runtime,
                      weights: Weights | None = None) -> Applied:
    # zero3-offload's shards live in host RAM; FSDP2 copies them to the device for compute
    device = "cpu" if plan.offload_params else rt.device
    if weights is not None and not plan.split and plan.pp == 1 and plan.engine in ("fsdp", "local"):
        fill(engine.module, weights, device)  # DDP's replicas, stages and the offload engine: elsewhere
    elif weights is None and _materialises(plan, rt):
        materialise_from_rank0(engine.module, full, rt, device)
    return engine


def apply_offloading(engine: Applied, plan: ParallelPlan, cfg, rt: Runtime, weights: Weights | None = None) -> Applied:
    eager = cfg.max_grad_norm <= 0 and cfg.precision != "fp16"  # no global norm needed before a host step
    if plan.engine == "offload":
        stages = engine if plan.pp > 1 else None  # the pipeline runs the batches, the engine the update
        # stages were filled at the split; a whole meta model is placed by the engine from `weights`
        source = WholeParams(engine.module, weights, rt.device) if weights is not None and stages is None else None
        return apply_offload(engine.module, plan.name, rt, compute_dtype(cfg.precision), delayed=cfg.delayed_update,
                             weights=source,
                             nvme_dir=_nvme_dir(plan, cfg), eager=eager,
                             nvme_host_bytes=(cfg.nvme_host_gb or 0) * 1e9 / _local_ranks(),  # None: filled by train_command
                             grads_on_device=cfg.offload_grads == "device", stages=stages,
                             state_format=cfg.optimizer_states,
                             tied=[(p, counted) for p, _, counted in stages.tied_params()] if stages else ())
    if plan.offload_params and eager and plan.pp == 1:  # stages: the step follows the schedule
        return stream_host_steps(engine, rt.device)
    return engine


def _local_ranks() -> int:
    """The node's ranks share its host RAM budget (--nvme-host-gb is per node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _nvme_dir(plan: ParallelPlan, cfg) -> str | None:
    """The NVMe tier: one directory per rank (each keeps only its own rows' states)."""
    if plan.offload != "nvme":
        return None
    return os.path.join(cfg.nvme_dir or os.path.join(cfg.output_dir, "nvme"), f"rank-{os.environ.get('RANK', '0')}")
