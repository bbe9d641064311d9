"""`bigfit.hf.use(trainer, **settings)`: a Hugging Face Trainer (or a TRL trainer built on it: SFTTrainer,
DPOTrainer) trains on bigfit's strategies. Two lines of the user's script change:

    import bigfit.hf
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds)
    bigfit.hf.use(trainer, strategy="zero2-offload")      # or strategy="auto"
    trainer.train()

The integration point is Trainer's own public surface, which 4.56 to 5.x keep: the model attributes
(`model`, `model_wrapped`), its `optimizer` attribute (an optimizer set before train() is kept),
accelerate's `_is_accelerate_prepared` flag (prepare returns such a model and optimizer untouched:
no DDP around an FSDP2 module, no second autocast, no device move), the accelerator's `backward`
and `clip_grad_norm_` (replaced on this trainer's accelerator only), and a TrainerCallback for
checkpoints. Trainer keeps its loop, data, loss, lr schedule, logging, evaluation and saving; the
engine (`bigfit.prepare`) owns precision, backward, clipping, the optimizer step and sharding.
Why not the others: a Trainer subclass changes the user's class line (and TRL's classes are
subclasses already); accelerate's plugins (DeepSpeed, FSDP) are configured through
TrainingArguments and accelerate's state, whose shape moved between 4.56 and 5.x.
"""
from __future__ import annotations

import torch

from ..errors import BigfitError
from ..layout.plan import plan_for
from .engine import UserEngine
from .hfparts import EngineCheckpoints, EngineOptimizer, resumed_train, saved_model
from .prepare import prepare

# TrainingArguments' optimizers that are bigfit's AdamW (torch's, fused or not)
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")


def use(trainer, /, **settings) -> UserEngine:
    """Train `trainer` (a transformers Trainer, or TRL's SFTTrainer, DPOTrainer, ...) on bigfit's engine
    for `settings` (bigfit.prepare's: strategy="zero2", ...); TrainingArguments give the rest (lr, weight
    decay, Adam betas and epsilon, max_grad_norm, seed, precision from bf16/fp16, activation
    checkpointing, the batch split). Call it on every rank, after the trainer is built and before
    train(). Returns the engine (engine.plan says what was applied); trainer.bigfit holds it too."""
    _check_trainer(trainer)
    world = trainer.accelerator.num_processes
    settings = {**from_args(trainer.args, world, settings), **settings}
    _check_layout(settings, world)
    sample = first_batch(trainer) if settings.get("strategy") == "auto" else None
    tokenizer = getattr(trainer, "processing_class", None)
    engine = prepare(trainer.model, sample=sample, tokenizer=tokenizer if hasattr(tokenizer, "save_pretrained") else None,
                     **settings)
    _check_applied(engine, world)
    _wire(trainer, engine)
    return engine


def from_args(args, world: int, settings: dict) -> dict:
    """bigfit's settings from TrainingArguments. The batch: each rank's micro-batch is Trainer's
    per-device batch, and the global batch micro x accumulation x data-parallel ranks, so the engine
    accumulates as many micro-batches as Trainer does."""
    plan = _plan(settings, world)
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    checkpointing = bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))
    return dict(lr=args.learning_rate, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                adam_beta2=args.adam_beta2, adam_eps=args.adam_epsilon, max_grad_norm=args.max_grad_norm or 0.0,
                seed=args.seed, precision=precision, activation_checkpointing=checkpointing,
                micro_batch_size=micro, batch_size=micro * accum * (plan.dp if plan else world))


def first_batch(trainer) -> dict:
    """strategy="auto" rates a batch like Trainer's: its train dataloader's first. A preference batch
    (DPO: chosen and rejected, no input_ids) is rated as both halves of the longest one."""
    batch = next(iter(trainer.get_train_dataloader()))
    if torch.is_tensor(batch.get("input_ids")):
        return {k: v for k, v in batch.items() if k in ("input_ids", "labels") and torch.is_tensor(v)}
    ids = [v for k, v in batch.items() if k.endswith("input_ids") and torch.is_tensor(v)]
    if not ids:
        raise BigfitError(f"bigfit.hf.use(strategy='auto'): the train dataloader's batch has no input_ids (keys "
                          f"{sorted(batch)}); name a strategy instead (strategy='zero2', ...)")
    rows, length = int(ids[0].shape[0]), sum(int(v.shape[-1]) for v in ids)
    return {"input_ids": torch.zeros(2 * rows, length, dtype=torch.long)}


def _check_trainer(trainer) -> None:
    """One line for a trainer that is not Trainer-shaped or already spreads the model its own way."""
    args = getattr(trainer, "args", None)
    if args is None or not hasattr(trainer, "accelerator") or not hasattr(trainer, "create_optimizer"):
        raise BigfitError(f"bigfit.hf.use(): takes a transformers Trainer (or a TRL trainer), not "
                          f"{type(trainer).__name__}; for your own loop call bigfit.prepare(model)")
    if getattr(trainer, "bigfit", None) is not None:
        raise BigfitError("bigfit.hf.use(): this trainer already trains on bigfit (trainer.bigfit); build a new "
                          "Trainer to change the strategy")
    for name in ("deepspeed", "fsdp"):
        if getattr(args, name, None):
            raise BigfitError(f"bigfit.hf.use(): TrainingArguments has {name}={getattr(args, name)!r}; bigfit's strategy "
                              f"replaces it: drop {name}= (strategy='zero3' shards like ZeRO-3/FSDP)")
    if cast := [n for n in ("bf16_full_eval", "fp16_full_eval") if getattr(args, n, False)]:
        raise BigfitError(f"bigfit.hf.use(): {cast[0]}=True casts and moves the whole model for evaluation; drop it "
                          "(the engine's precision applies to evaluation too)")
    if getattr(args, "auto_find_batch_size", False):
        raise BigfitError("bigfit.hf.use(): auto_find_batch_size=True rebuilds the model's wrapping after an "
                          "out-of-memory error; drop it (bigfit's micro_batch_size='auto' finds one with bigfit train)")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ADAMW:
        raise BigfitError(f"bigfit.hf.use(): TrainingArguments has optim={optim!r}; bigfit's engines step AdamW "
                          f"(optim one of {', '.join(ADAMW)})")
    if trainer.optimizer is not None:
        raise BigfitError("bigfit.hf.use(): the Trainer was given an optimizer (optimizers=...); bigfit's engine "
                          "builds its own: drop optimizers= and set lr and weight decay in TrainingArguments")


def _plan(settings: dict, world: int):
    """The plan a named strategy makes at this world size (None for auto: known once it picks)."""
    strategy = settings.get("strategy", "single" if world == 1 else "ddp")
    if strategy == "auto":
        return None
    try:
        return plan_for(strategy, world, tp=settings.get("tp", 1), pp=settings.get("pp", 1),
                        dp_shard=settings.get("dp_shard"), dp_replicate=settings.get("dp_replicate"))
    except (BigfitError, TypeError, ValueError):
        return None  # bigfit.prepare says what is wrong with the strategy, in its words


def _check_layout(settings: dict, world: int) -> None:
    plan = _plan(settings, world)
    if plan is not None:
        _refuse(plan.tp, plan.pp, plan.dp, plan.name, world)
    else:  # a strategy bigfit.prepare will refuse, or auto: the degrees asked for by name
        tp, pp = settings.get("tp") or 1, settings.get("pp") or 1
        _refuse(tp, pp, world, settings.get("strategy", "auto"), world)


def _check_applied(engine: UserEngine, world: int) -> None:
    """strategy="auto"'s pick, checked as a named strategy is before any work."""
    plan = engine.job.plan
    try:
        _refuse(plan.tp, plan.pp, engine.rt.data.world_size, plan.name, world)
    except BigfitError:
        engine.close()
        raise


def _refuse(tp: int, pp: int, dp: int, name: str, world: int) -> None:
    """Trainer's dataloader gives every process its own rows (accelerate shards over all of them):
    bigfit's data-parallel ranks must be those processes, with no tensor or pipeline peers."""
    if tp > 1 or pp > 1:
        raise BigfitError(f"bigfit.hf.use(): strategy {name} has {'tensor' if tp > 1 else 'pipeline'}-parallel peers "
                          f"(tp={tp}, pp={pp}), but Trainer's dataloader gives each of its {world} processes other "
                          "rows; pick a data-parallel strategy (single, ddp, zero1/2/3, *-offload, device_map)")
    if dp != world:
        raise BigfitError(f"bigfit.hf.use(): strategy {name} has {dp} data-parallel ranks, but Trainer shards its data "
                          f"over {world} processes; pick a strategy whose ranks are the processes")


def _wire(trainer, engine: UserEngine) -> None:
    """The engine in Trainer's places (module docstring)."""
    accelerator, args = trainer.accelerator, trainer.args
    for model in (engine.model, engine.module):
        model._is_accelerate_prepared = True  # accelerate's prepare returns it untouched
    trainer.model, trainer.model_wrapped = engine.module, engine.model
    optimizer = EngineOptimizer(engine)
    trainer.optimizer = optimizer  # create_optimizer keeps an optimizer already set
    # Trainer divides the loss by its accumulation steps (or normalises by the batch's tokens) itself
    accelerator.backward = lambda loss, **kw: engine.backward(loss, scale_by_accumulation=False)
    # Trainer asks for the gradient norm before it steps; the engine clips (max_grad_norm) inside its
    # step, and the norm Trainer logs is the one that step measured (EngineOptimizer.norm)
    accelerator.clip_grad_norm_ = lambda parameters, max_norm, norm_type=2: optimizer.norm
    # the micro-batch that ends an accumulation: Trainer's count (a short last one at an epoch's end)
    engine.syncs = lambda: accelerator.sync_gradients
    # bigfit applies its own activation checkpointing (settings); Trainer would add a second one
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(args, name, False):
            setattr(args, name, False)
    trainer.add_callback(EngineCheckpoints(engine))
    trainer.train = resumed_train(trainer, optimizer)
    trainer.save_model = saved_model(trainer, engine)
    # Trainer loads model.safetensors of the checkpoint it resumes into self.model before the optimizer:
    # the engine's checkpoint holds the same weights (loaded with the optimizer, EngineOptimizer), and
    # FSDP2's DTensor parameters refuse whole tensors: the engine's load alone restores them
    trainer._load_from_checkpoint = lambda *a, **kw: None
    trainer.bigfit = engine

