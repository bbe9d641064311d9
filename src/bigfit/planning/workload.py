"""The job the planner rates: batch, lengths, precision and the settings that change bytes or time.
Pure data, below everything that plans (planning/automap.py, planning/search.py use it)."""
from __future__ import annotations

from dataclasses import dataclass

from ..adapters.lora import LoraSettings


@dataclass(frozen=True)
class Workload:
    batch_size: int  # global samples per optimizer step
    seq_len: int  # tokens per sample (source side for encoder-decoders)
    target_len: int = 0  # decoder tokens per sample (encoder-decoders)
    micro_batch: int | None = None  # None: batch_size / world size
    precision: str = "bf16"
    checkpointing: bool = False  # activation checkpointing: every block, or the first `checkpoint_blocks` of each stack
    checkpoint_blocks: int | None = None  # with checkpointing: how many blocks of each stack (None: all)
    offload_activations: bool = False  # with checkpointing: the checkpointed blocks' inputs in pinned host RAM
    # --activations auto: each rated row keeps its activations the fastest way that fits (planning/keeping.py);
    # the fields above are then where the choice starts (keep)
    choose_activations: bool = False
    loss_chunk: int | None = 0  # tokens per chunk of the LM head and loss (layout/activations.py); 0: whole, None: auto
    context_parallel: bool = False  # composed plans rate context-parallel degrees too (bigfit plan, --strategy auto)
    delayed_update: bool = False  # zero2-offload's host step overlaps the next step
    offload_grads: str = "host"  # zero2-offload: where gradients wait for the host step (host or device)
    nvme_host_gb: float | None = 0.0  # zero2-offload-nvme: GB of states per node kept in RAM; None: what RAM leaves
    # zero2-offload(-nvme): the host moments' format (config.OPTIMIZER_STATES); None: the most exact that fits
    optimizer_states: str | None = "fp32"
    clipping: bool = True  # a global gradient norm is needed before the host step (max_grad_norm > 0)
    chunks: int | None = None  # GPipe / pipeline micro-batches per micro-batch; None: device_map 1, pipeline one per stage
    pipeline_schedule: str | None = None  # pipeline: gpipe, 1f1b, interleaved; None: 1f1b (config.pipeline_defaults)
    stages_per_rank: int | None = None  # pipeline: stages per process; None: 2 if interleaved, else 1
    sequence_parallel: bool = False  # composed plans with tp > 1 and no pipeline split the sequence
    compile: bool = False  # blocks compiled (torch.compile): the host issues far fewer kernels (hostcost.py)
    lora: LoraSettings | None = None  # LoRA adapters beside the frozen base (adapters.py); None: full fine-tuning
    load_in_4bit: bool = False  # with lora: the base layers in 4 bits (QLoRA, quantized.py): single, ddp and FSDP2 rows

    def micro(self, world: int) -> int:
        """The micro-batch per process: given, or the whole per-process share (no accumulation)."""
        return self.micro_batch or max(1, self.batch_size // world)

    def checkpointed(self, stacks: list[tuple[str, int]], n_blocks: int) -> list[bool]:
        """Which blocks, in execution order, are checkpointed: none, every one, or the first
        `checkpoint_blocks` of each stack (`stacks`: a profile's (path, blocks); a profile built by
        hand without them: the first of all `n_blocks`)."""
        if not self.checkpointing:
            return [False] * n_blocks
        k = n_blocks if self.checkpoint_blocks is None else self.checkpoint_blocks
        return [i < k for _, n in (stacks or [("", n_blocks)]) for i in range(n)]

    @property
    def keeping(self) -> str:
        """How the activations are kept, as --activations names it (with the blocks where not all)."""
        if not self.checkpointing:
            return "keep"
        how = "offload" if self.offload_activations else "checkpoint"
        return how + (f" {self.checkpoint_blocks} blocks" if self.checkpoint_blocks is not None else "")


def planned_lengths(cfg, lengths: tuple[int, int] | None = None) -> tuple[int, int]:
    """The source and target tokens of a training run's longest batch, as the planner rates it: the
    data's longest samples where the command read them (`lengths`: job/prepare.py data_lengths, a
    job's DataRef.lengths), else --max-source-len and --max-target-len, which are limits, not lengths."""
    if not lengths:
        return cfg.max_source_len, cfg.max_target_len
    return max(1, min(cfg.max_source_len, lengths[0])), max(1, min(cfg.max_target_len, lengths[1]))
