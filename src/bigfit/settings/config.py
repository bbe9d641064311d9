"""The training job's configuration: one typed dataclass, defaults -> file -> command line.

Every "auto" / None default is resolved in one place, job/resolution.py's `resolve`, once the world size
is known, so the rest of the code only ever sees concrete numbers. This module imports no other of
bigfit's: reading.py (reading), job/checks.py (validating) and job/resolution.py sit above it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# What each data-parallel strategy shards across ranks (DeepSpeed's ZeRO stages) and keeps in host RAM.
# (each strategy is an alias of a parallel plan: layout/plan.py ALIASES)
STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "zero2-offload-nvme")
# ...and the model split over devices by one process (naive model parallelism, optionally GPipe chunks)
SPLIT_STRATEGIES = ("device_map",)
# ...and the model cut into stages, one process per stage (or more: interleaved), torch.distributed.pipelining
PIPELINE_STRATEGIES = ("pipeline",)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam")
# zero2-offload's host Adam moments (offload/statefmt.py): bytes a parameter with the fp32 master
# weights 12, 8, about 6
OPTIMIZER_STATES = ("fp32", "bf16", "int8")
STATE_BYTES = {"fp32": 12.0, "bf16": 8.0, "int8": 6.0 + 8 / 256}  # int8: a 4-byte scale per 256 for each moment
SCHEDULES = ("linear", "cosine", "constant")
WARMUPS = ("linear", "log")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
ACTIVATIONS = ("auto", "keep", "checkpoint", "offload")  # --activations: how each block's activations are kept
REPORTERS = ("tensorboard", "wandb", "mlflow")  # --report-to: each the name of the package it needs (training/trackers.py)
# Fields that take "auto": stored as None and derived in `resolve`...
AUTO = ("nproc", "precision")
# ...or kept as "auto" until planning (and a probe) picks the value: bigfit train does this first.
PLANNED = ("strategy", "batch_size", "micro_batch_size")
# The commands that take each TrainConfig field (reading.py's schema declares every setting from these and
# from the plan's and the bench's own dataclasses). bigfit train takes them all. bigfit plan takes the job's
# settings that change what it rates (the data's among them: --data is rated at its longest sample); the
# others (learning rate, outputs, evaluation...) it refuses in one line naming the commands that take them.
PLAN_TAKES = ("model", "data", "data_encoding", "data_columns", "data_split", "data_config", "chat_template",
              "data_cache", "dataset_num_proc", "max_source_len", "max_target_len", "pack", "eval_samples", "seed",
              "batch_size", "micro_batch_size", "nproc", "strategy", "pp", "tp", "dp_shard", "dp_replicate",
              "sequence_parallel", "cp", "precision", "activation_checkpointing", "activations",
              "checkpoint_blocks", "loss_chunk", "compile", "chunks", "pipeline_schedule",
              "stages_per_rank", "delayed_update", "offload_grads", "nvme_host_gb", "optimizer_states",
              "max_grad_norm", "lora", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "load_in_4bit")
# ...and bigfit bench takes every field but those it decides for each of its rows itself (or names
# otherwise: its own --output-dir and --overwrite are its directory's, settings/bench.py)
BENCH_DECIDES = ("resume", "consolidate", "checkpoints", "eval_on_start", "probe_only", "strategy", "precision",
                 "batch_size", "micro_batch_size", "max_steps", "eval_every", "save_every",
                 "keep_checkpoints", "allow_changed", "report_to", "max_train_samples", "output_dir", "overwrite")
# Values a flag takes alone (`--resume` is `--resume latest`), and the values `bigfit plan`'s parser
# offers (train and bench check them in job/checks.py, for files and flags alike)
FLAG_ALONE = {"resume": "latest"}
CHOICES = {"precision": (*PRECISIONS, "auto"), "optimizer_states": (*OPTIMIZER_STATES, "auto"),
           "offload_grads": ("host", "device"), "activations": ACTIVATIONS, "pipeline_schedule": PIPELINE_SCHEDULES}


def commands_of(name: str) -> tuple[str, ...]:
    """The commands that take TrainConfig field `name`."""
    return ("train",) + ("plan",) * (name in PLAN_TAKES) + ("bench",) * (name not in BENCH_DECIDES)


@dataclass
class TrainConfig:
    """What to train, on what, and how. Field comments are the `--help` texts."""

    model: str | None = None  # hub name, local dir with weights, or dir with only config.json; None: embedded tiny T5
    data: str | None = None  # JSONL, CSV, .txt, parquet/arrow, a saved dataset dir or a hub dataset name; None: embedded task
    data_encoding: str = "utf-8"  # text encoding of --data files (JSONL, CSV, text)
    data_columns: str | None = None  # source=COL,target=COL or text=COL (source=translation.en); None: source/target, prompt/completion or text
    data_split: str = "train"  # the split of a saved DatasetDict or a hub dataset
    data_config: str | None = None  # a hub dataset's configuration (load_dataset's name, e.g. ro-en)
    chat_template: str | None = None  # a Jinja chat template FILE for messages data; None: the tokenizer's own
    data_cache: str = "auto"  # tokenized data in memory-mapped files a node's ranks share: on, off, a DIR, or auto (on from 64 MB of --data); on: $XDG_CACHE_HOME/bigfit/tokenized
    dataset_num_proc: int | None = None  # processes that tokenize --data into the cache; None: the machine's cores
    output_dir: str = "bigfit-out"  # checkpoints, metrics.jsonl, consolidated model; one run's, locked while it runs
    overwrite: bool = False  # replace the run already in --output-dir: its files only, never files bigfit did not write
    report_to: str = "none"  # dashboards besides metrics.jsonl, comma-separated: tensorboard, wandb, mlflow; none
    max_steps: int = 600  # optimizer steps
    batch_size: int | str = 32  # GLOBAL batch: samples per optimizer step, over all processes and micro-batches
    # samples per forward/backward on one process; None: --batch-size / --nproc; auto: the largest predicted
    # to fit, confirmed by a probe run (with --batch-size auto too: the global batch is --nproc x that)
    micro_batch_size: int | str | None = None
    seed: int = 0  # weights, data order and dropout
    nproc: int | None = None  # local worker processes; None: one per GPU, or 2 on a CPU-only machine
    strategy: str = "zero3"  # one of STRATEGIES, SPLIT_STRATEGIES, PIPELINE_STRATEGIES, or auto: the fastest that the planner predicts to fit
    device_map: str | None = None  # --strategy device_map: MAP.json (docs/device_map.md) or auto: balanced over GPUs, then RAM
    chunks: int | None = None  # --strategy device_map or pipeline: pipeline micro-batches per micro-batch; None: 1, pipeline: one per stage
    pipeline_schedule: str | None = None  # pipeline: gpipe, 1f1b or interleaved (1F1B, several stages per process); None: 1f1b
    stages_per_rank: int | None = None  # pipeline: stages per process (interleaved: 2 or more); None: 2 if interleaved, else 1
    # parallel degrees (docs/architecture.md, "The plan"): they multiply to the processes; None: 1, except
    # the one the strategy spreads over (pp for pipeline, dp_replicate for ddp, dp_shard for zero*) takes the rest
    pp: int | None = None  # pipeline positions: the model cut into stages, each a process (x data parallel)
    tp: int | None = None  # tensor parallel: each block's matrices split over this many processes
    dp_shard: int | None = None  # data-parallel processes that shard model states (zero1/2/3, FSDP2)
    dp_replicate: int | None = None  # data-parallel replicas (ddp; HSDP with --dp-shard)
    # with --tp: the residual stream, its norms and dropout split by sequence over the TP ranks
    # (Megatron's sequence parallelism: attention and MLP inputs all-gathered, outputs reduce-scattered)
    sequence_parallel: bool = False
    # context parallel: each sequence split over this many processes (two slices each, one from either end,
    # so the causal mask gives every rank the same work); attention gathers the whole sequence's keys and
    # values over them. Decoder-only models (docs/long_sequences.md)
    cp: int | None = None
    # fp32, bf16 or fp16 (fp32 master weights either way); None: auto, bf16 where the devices compute it (a GPU
    # that has it; bigfit plan: the GPUs it rates), else fp32 (the CPU)
    precision: str | None = None
    reduce_dtype: str = "fp32"  # dtype gradients are reduced in under bf16/fp16
    loss_scale: float = 0.0  # fp16: a static loss scale; 0 for dynamic scaling
    initial_scale_power: int = 16  # fp16 dynamic scaling starts at a scale of 2 to this power
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles
    hysteresis: int = 2  # fp16: overflows tolerated before the scale halves
    min_loss_scale: float = 1.0  # fp16: the scale never drops below this
    activation_checkpointing: bool = False  # recompute each block's activations in backward instead of storing them
    # how each block's activations are kept: keep (stored for backward), checkpoint (only the block's input
    # stored, the rest recomputed in backward), offload (checkpoint, and each block's input copied to pinned host
    # RAM during forward, back before its backward); auto: the planner's fastest that fits the GPUs (keep where
    # it cannot rate the job, and on a machine without a GPU). --activation-checkpointing is checkpoint
    activations: str = "auto"
    checkpoint_blocks: int | None = None  # checkpoint / offload: how many blocks, the first of each stack; None: every block
    # tokens per chunk of the LM head and its loss: the logits of one chunk exist at a time, in forward and
    # backward (the head's matmul runs again in backward); 0: the whole logits; None: auto, chunks of at most
    # 1 GiB of fp32 logits where the whole would be more (decoder-only models)
    loss_chunk: int | None = None
    compile: bool = False  # torch.compile each block's forward for training (fused kernels); the first steps compile
    compile_backend: str = "inductor"  # --compile's backend (aot_eager, eager: tracing without code generation)
    optimizer: str = "adamw"  # adamw (decoupled weight decay) or adam (L2 weight decay)
    lr: float = 1e-3  # peak learning rate
    adam_beta1: float = 0.9  # Adam first-moment decay
    adam_beta2: float = 0.999  # Adam second-moment decay
    adam_eps: float = 1e-8  # Adam denominator epsilon
    weight_decay: float = 0.0  # weight decay
    lr_schedule: str = "linear"  # after warm-up: linear (to --min-lr at --max-steps), cosine (to --min-lr), constant
    warmup_steps: int = 20  # warm-up steps from --warmup-min-lr to --lr
    warmup_type: str = "linear"  # warm-up curve: linear or log (DeepSpeed WarmupLR's default)
    warmup_min_lr: float = 0.0  # learning rate at the start of warm-up
    min_lr: float = 0.0  # where linear and cosine decay end (DeepSpeed's WarmupDecayLR calls it its minimum learning rate)
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0: no clipping
    ddp_bucket_mb: float = 25.0  # gradient all-reduce bucket size in MB (ddp, zero1)
    nvme_dir: str | None = None  # zero2-offload-nvme: a directory on a fast local disk; None: OUTPUT/nvme
    delayed_update: bool = False  # zero2-offload: the host optimizer step overlaps the next step (one-step-stale parameters)
    offload_grads: str = "host"  # zero2-offload: where gradients wait for the host step: host (2 more bytes/param of RAM in bf16, 4 in fp32) or device
    # zero2-offload-nvme: GB of optimizer states per node kept in host RAM (the first blocks'), the rest in files;
    # None: what the RAM leaves beside the rest, as the plan rates it; 0: every state in files (DeepSpeed's way)
    nvme_host_gb: float | None = None
    # bf16 moments are stochastically rounded; int8 ones are 8-bit codes with a scale per block of 256 (statefmt.py)
    optimizer_states: str = "auto"  # zero2-offload: Adam's moments in host RAM: fp32, bf16 or int8 (with the fp32 master 12, 8, ~6 bytes a parameter); auto: fp32, or what --strategy auto picks
    max_source_len: int = 128  # tokens kept per source / text sample
    max_target_len: int = 128  # tokens kept per target (encoder-decoder models)
    pack: bool = False  # decoder-only: samples end to end in sequences of --max-source-len tokens, attention kept within each
    save_every: int = 200  # save a checkpoint every N steps (and always at the end); 0: only at the end
    keep_checkpoints: int = 0  # keep only the newest N complete checkpoints; 0 keeps all
    eval_every: int = 200  # evaluate every N steps and at the end (and at step 0 unless --no-eval-on-start); 0: at the end only
    eval_on_start: bool = True  # --no-eval-on-start: skip the evaluation before the first step (the baseline)
    # held-out samples used for evaluation, at most a tenth of the data (a larger number is refused once the data
    # is read; the default 64 takes a tenth of data under 640 samples); 0: no evaluation
    eval_samples: int = 64
    max_train_samples: int | None = None  # train on the first N samples only (after the held-out ones); None: all
    num_beams: int = 4  # beam width for generate() during evaluation
    max_new_tokens: int = 32  # generation length limit during evaluation
    resume: str | None = None  # latest (the newest complete checkpoint in --output-dir; the flag alone means it) or a checkpoint dir
    allow_changed: str | None = None  # --resume: comma-separated settings that may differ from the checkpoint's although they change the math
    timeout_s: float = 300.0  # seconds a collective may wait: a stuck peer fails the job instead of hanging it
    consolidate: bool = True  # --no-consolidate: skip writing OUTPUT/model (Hugging Face format; --lora: OUTPUT/adapter) at the end
    # parameter-efficient fine-tuning (bigfit/adapters/lora.py): LoRA adapters through peft, the base frozen
    lora: bool = False  # train LoRA adapters beside the frozen base weights (peft), with any strategy
    lora_r: int = 16  # --lora: the adapters' rank
    lora_alpha: float = 32.0  # --lora: the adapters' scale is alpha / r
    lora_dropout: float = 0.05  # --lora: dropout on the adapters' input
    lora_targets: str = "all-linear"  # --lora: linear layers that get adapters: all-linear, or names (q_proj,v_proj)
    load_in_4bit: bool = False  # --lora: the frozen base layers in 4 bits (QLoRA: NF4, double quantisation, bf16 compute; adapters/quantize.py)
    # --no-checkpoints: save no checkpoint, not even the end's, hence no model directory either and nothing
    # to resume: throwaway runs and benchmarks, or a model whose states would not fit on the disk
    checkpoints: bool = True
    probe_only: bool = False  # internal: one step on the longest samples, then exit (micro-batch auto's probe)

    @staticmethod
    def field_names() -> list[str]:
        return [f.name for f in dataclasses.fields(TrainConfig)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)



@dataclass(frozen=True)
class Range:
    """The numbers a setting may hold, from `low` to `high` (each end valid unless `*_open`), and how an
    error says so: `words` where the numbers alone would not say it best, `note` what an end means."""
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    words: str = ""
    note: str = ""

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and (value < self.high if self.high_open else value <= self.high)

    def describe(self, note: bool = True) -> str:
        """The range in words, with what an end means unless `note` is False (`bigfit plan` names the range alone)."""
        low, high = _number(self.low), _number(self.high)
        text = f"more than {low}" if self.low_open else "0 or more" if self.low == 0 else f"at least {low}"
        if self.high < math.inf:
            text = f"at least {low} and less than {high}" if self.high_open else f"from {low} to {high}"
        return (self.words or text) + (f" ({self.note})" if self.note and note else "")


def _number(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else f"{x:g}"


POSITIVE_INT = Range(1, words="a positive integer")
AT_LEAST_1, AT_LEAST_0, ABOVE_0 = Range(1), Range(0), Range(0, low_open=True)
# Every numeric setting's valid values (job/checks.py refuses the rest in one line before torch loads; torch's
# optimizers would raise a traceback at the first step). None and "auto" are checked as types, not here;
# the --lora-* numbers are LoraSettings' (adapters/lora.py), checked where --lora is on.
RANGES = {
    "dataset_num_proc": AT_LEAST_1, "max_steps": POSITIVE_INT, "batch_size": POSITIVE_INT,
    "micro_batch_size": ABOVE_0, "nproc": AT_LEAST_1, "chunks": POSITIVE_INT, "stages_per_rank": AT_LEAST_1,
    "seed": Range(0, 2**32 - 1),  # the data order's generator takes seed x 1000003 + epoch as a 64-bit integer
    **dict.fromkeys(("pp", "tp", "cp", "dp_shard", "dp_replicate", "checkpoint_blocks"), POSITIVE_INT),
    "loss_chunk": Range(0, note="0: the whole logits"),
    "loss_scale": Range(0, note="0: dynamic scaling"),
    "initial_scale_power": Range(0, 127),  # 2**128 is past float32's range: every step would overflow
    "loss_scale_window": AT_LEAST_1, "hysteresis": AT_LEAST_1, "min_loss_scale": ABOVE_0,
    "lr": ABOVE_0, "adam_beta1": Range(0, 1, high_open=True), "adam_beta2": Range(0, 1, high_open=True),
    "adam_eps": ABOVE_0, "weight_decay": AT_LEAST_0, "warmup_steps": AT_LEAST_0, "warmup_min_lr": AT_LEAST_0,
    "min_lr": AT_LEAST_0, "max_grad_norm": Range(0, note="0: no clipping"), "ddp_bucket_mb": ABOVE_0,
    "nvme_host_gb": Range(0, note="0: every state in files"), "max_source_len": POSITIVE_INT,
    "max_target_len": POSITIVE_INT, "save_every": Range(0, note="0: at the end only"),
    "keep_checkpoints": Range(0, note="0 keeps all"), "eval_every": Range(0, note="0: at the end only"),
    "eval_samples": Range(0, note="0: no evaluation"), "max_train_samples": AT_LEAST_1, "num_beams": POSITIVE_INT,
    "max_new_tokens": POSITIVE_INT, "timeout_s": ABOVE_0,
}


def pipeline_defaults(schedule: str | None, stages_per_rank: int | None, chunks: int | None, world_size: int,
                      micro: int) -> tuple[str, int, int]:
    """(schedule, stages per rank, chunks) of `--strategy pipeline`, None filled in: 1f1b; 2 stages per
    rank for interleaved, else 1; the fewest chunks that divide the micro-batch and give every stage
    one (interleaved: a multiple of the processes). The planner rates the same layout."""
    schedule = schedule or "1f1b"
    per = stages_per_rank or (2 if schedule == "interleaved" else 1)
    fill = [d for d in range(1, micro + 1) if micro % d == 0 and d >= world_size * per
            and (schedule != "interleaved" or d % world_size == 0)]
    return schedule, per, chunks or (fill[0] if fill else micro)  # too small a micro-batch: the layout check says so


def auto_precision() -> str:
    """bf16 where the accelerator computes it natively, else fp32."""
    import torch

    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
