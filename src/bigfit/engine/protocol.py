"""The one protocol the training loop, evaluation and checkpoints talk to (`Engine`), and `Applied`,
its plain implementation: the model (or a DDP / FSDP2 wrapper of it) and a torch optimizer.

Each engine (FSDP2, DDP + ZeRO-1, the offload engine, device maps, pipeline stages) subclasses
Applied and overrides only what it does differently, so a new strategy knows from `Engine` what it
must provide, and the loop never asks an object what it can do.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed.tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..context import ContextParallel
from ..context.split import shifted_labels
from ..tensor import param_groups, whole_logits
from .chunkloss import ChunkedHead
from .losses import model_logits, target_tokens, token_loss
from .norms import clip_by, global_norm


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer steps: all of them, or a LoRA run's adapters (the base frozen)."""
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def syncing(owner, sync: bool):
    """`owner.sync` is `sync` inside (False for accumulation micro-batches, whose gradients wait for
    the last one), True again after, also after an error."""
    owner.sync = sync
    try:
        yield
    finally:
        owner.sync = True


def grad_hook(method: Callable) -> Callable:
    """`method` of an engine as a parameter's post-accumulate-grad hook, held weakly. torch keeps that
    hook from the tensor's C++ side, out of sight of Python's collector: a bound method there kept its
    engine, and the engine its parameters, past the run (every offload engine, its host buffers with
    it, stayed alive in a process that ran three: a notebook, the tests' kept ranks)."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        if (bound := ref()) is not None:
            bound(p)
    return hook


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t


@dataclass
class Loading:
    """What a checkpoint loads into: `state` (as `checkpoint_state(loading=True)`), then each of
    `pieces` in turn, a state and what to do once it is loaded (states the checkpoint holds in another
    form than the engine keeps them, converted a part at a time), and `note`, a line saying so."""
    state: dict
    pieces: list[tuple[dict, Callable[[], None]]] = field(default_factory=list)
    note: str | None = None


class Engine(Protocol):
    """What a strategy gives the loop. One step: `set_lr`, `run_batch` per micro-batch, `update`."""

    model: torch.nn.Module  # what forward passes call (a DDP wrapper, an FSDP2 module, the model)
    module: torch.nn.Module  # the Hugging Face model itself: config, generate(), state dict names
    strategy: str  # the plan's name, for messages
    notes: list[str]  # what was applied, for the start-of-run table
    generates: bool  # evaluation may call generate()
    counts: bool  # this rank's losses and texts are counted: False on tensor-parallel peers, which repeat them
    sequence_multiple: int  # batches are padded to a multiple of this length (sequence parallelism: tp)
    # a step that ran out of memory can be dropped (`recover_from_oom`) and the next one run in this
    # process (micro-batch auto's probe, training/probe.py); else its probe restarts the processes
    recovers_from_oom: bool
    # the optimizer step goes on after `update` returns, under the next forward, until `flush` (the
    # offload engine's host step): micro-batch auto's probe runs two steps a size to meet both at once
    updates_in_background: bool
    # False: checkpoints hold the trainable parameters and the optimizer only (a LoRA run: its frozen
    # base is made again from its source on every start, so it need not be saved)
    frozen_in_checkpoints: bool

    def attach_optimizer(self, cls: type, **kw) -> None:
        """Build the optimizer over the parameters, where the strategy keeps its states."""

    context_ranks: int  # ranks that split each sequence (context parallelism): the loop scales the loss by them

    def set_loss(self, fn: Callable | None) -> None:
        """`run_batch` computes each micro-batch's loss with `fn(logits, labels)` (the user's loop)."""

    def set_lr(self, lr: float) -> None: ...

    def run_batch(self, batch: dict, seq2seq: bool, factor: float, sync: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch, gradients scaled by `factor`; `sync` False for
        accumulation micro-batches. Returns the summed token loss (detached)."""

    def eval_batch(self, batch: dict, seq2seq: bool) -> tuple[float, int]:
        """(summed token loss, target tokens) of this rank's share: a sum over ranks gives the batch's."""

    def update(self, max_norm: float, loss_scale: float) -> float:
        """Unscale, clip and step unless the gradients overflowed; returns the global gradient norm."""

    def flush(self) -> None:
        """Land any update still under way (before anything reads the parameters)."""

    def checkpoint_state(self, loading: bool = False) -> dict:
        """{"model": ..., "optim": ...} keyed by parameter names, for DCP; `loading`: to load into."""

    def loading(self, saved: Mapping) -> Loading:
        """What to load a checkpoint into, given its entries (DCP's metadata by flattened key)."""

    def after_load(self, state: dict) -> None:
        """Take the values DCP wrote into `checkpoint_state(loading=True)`'s tensors."""

    def memory_tensors(self) -> dict[str, Iterable]:
        """{"params" | "grads" | "optimizer": tensors this rank holds}, for memory.py."""

    def forward_context(self): ...

    def accumulation_context(self, sync: bool):
        """Around a micro-batch's forward and backward: `sync` False skips the gradient reduction that
        the last micro-batch of the step does (DDP's no_sync, the offload engine's buckets)."""

    def generation_context(self): ...

    def reshard(self) -> None: ...

    def recover_from_oom(self) -> None:
        """After an out-of-memory error in micro-batch auto's probe: drop what the failed step left
        half made (an optimizer's states made inside its first step: the next step makes them again;
        the offload engine's buckets)."""


@dataclass
class Applied:
    """The plain engine: one process, or replicas whose wrapper reduces gradients (DDP)."""

    model: torch.nn.Module
    module: torch.nn.Module
    strategy: str
    autocast: torch.dtype | None = None  # autocast dtype for forward passes (mixed precision without FSDP)
    notes: list[str] = field(default_factory=list)
    generates: bool = True
    counts: bool = True
    sequence_multiple: int = 1
    recovers_from_oom: bool = True
    updates_in_background: bool = False
    norm_ranks: int = 0  # > 0: ranks whose gradients mix DTensors and plain tensors (tensor parallel)
    frozen_in_checkpoints: bool = True  # False: checkpoints hold the trainable parameters only (a LoRA run)
    optimizer: torch.optim.Optimizer | None = None
    # the user's loss, (logits, labels) -> loss (bigfit.prepare's loss_fn), in place of the summed token loss
    loss_fn: Callable | None = None
    # long sequences (decoder-only): each sequence split over context-parallel ranks; the head's loss in chunks
    context: ContextParallel | None = None
    chunked: ChunkedHead | None = None

    @property
    def context_ranks(self) -> int:
        """Ranks that split each sequence: gradients are averaged over them too (step.py)."""
        return self.context.size if self.context is not None else 1

    def set_loss(self, fn: Callable | None) -> None:
        """Compute each micro-batch's loss with `fn` (the user's: engine.forward_backward, a pipeline's schedule)."""
        self.loss_fn = fn

    # -- the optimizer -------------------------------------------------------------------------
    def recover_from_oom(self) -> None:
        # torch's Adam makes a parameter's exp_avg, then its exp_avg_sq: an OOM between them leaves a
        # state its next step reads as a KeyError (seen on an H200, T5-large fp32, 2026-12-04)
        if self.optimizer is not None:
            self.optimizer.state.clear()

    def attach_optimizer(self, cls: type, **kw) -> None:
        # one group per kind of tensor: fused kernels refuse plain tensors beside DTensors (tensor parallel);
        # frozen parameters (a LoRA base) are no optimizer's: no state, nothing in its checkpoint
        self.optimizer = cls(param_groups(trainable(self.model)), **kw)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:  # before backward: an engine may step during it
            group["lr"] = lr

    # -- forward and backward ------------------------------------------------------------------
    def loss_sum(self, batch: dict, seq2seq: bool) -> torch.Tensor:
        chunk = self.chunked.tokens_for(batch["labels"].numel() // self.context_ranks) if self.chunked else 0
        if self.loss_fn is None and not seq2seq and (self.context is not None or chunk):
            return self.sliced_loss(batch, chunk)
        with self.forward_context():
            logits = model_logits(self.model, self.module, batch, seq2seq)
        if self.loss_fn is not None:  # the user's (bigfit.prepare's loss_fn)
            return self.loss_fn(logits, batch["labels"])
        return token_loss(logits, batch["labels"], seq2seq)

    def sliced_loss(self, batch: dict, chunk: int) -> torch.Tensor:
        """A decoder-only micro-batch's summed loss over this rank's slice of every sequence (context
        parallelism: its tokens' part of the sum) and, with `chunk` tokens, the head's loss computed
        chunk by chunk (engine/chunkloss.py)."""
        piece = self.context.split(batch) if self.context is not None else None
        inputs = piece.inputs if piece is not None else batch
        targets = piece.targets if piece is not None else shifted_labels(batch["labels"])
        with contextlib.ExitStack() as inside:
            inside.enter_context(self.forward_context())
            if chunk:
                inside.enter_context(self.chunked.computing(targets, chunk))
            out = model_logits(self.model, self.module, inputs, False)
        return out.reshape(()) if chunk else token_loss(out, targets, False, shifted=True)

    def run_batch(self, batch: dict, seq2seq: bool, factor: float, sync: bool) -> torch.Tensor:
        with self.accumulation_context(sync):
            loss = self.loss_sum(batch, seq2seq)
            (loss * factor).backward()
        return loss.detach()

    def eval_batch(self, batch: dict, seq2seq: bool) -> tuple[float, int]:
        # context-parallel ranks each sum their slice's losses; the batch's targets are counted once
        counted = self.context is None or self.context.rank == 0
        return self.loss_sum(batch, seq2seq).item(), target_tokens(batch["labels"], seq2seq) if counted else 0

    def forward_context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        device = next(self.module.parameters()).device.type
        return torch.autocast(device, dtype=self.autocast)

    def accumulation_context(self, sync: bool):
        """Skip the gradient all-reduce on accumulation micro-batches (DDP); a no-op elsewhere."""
        if sync or not isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def generation_context(self):
        """What generate() needs around it: whole logits from a vocabulary-parallel LM head (it reads
        rows of them) and the model's own attention (whole sequences on every context-parallel rank);
        FSDP2 adds its root group's parameters (data_parallel/sharding.py)."""
        stack = contextlib.ExitStack()
        stack.enter_context(whole_logits(self.module))
        if self.context is not None:
            stack.enter_context(self.context.whole())
        return stack

    def reshard(self) -> None:
        """Return parameters to their at-rest layout after forward passes without backward."""

    # -- the update ----------------------------------------------------------------------------
    def update(self, max_norm: float, loss_scale: float) -> float:
        self.finish_backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if loss_scale != 1.0:
            for p in params:
                p.grad.div_(loss_scale)
        grad_norm = self.clip_grad_norm(params, max_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def finish_backward(self) -> None:
        """Combine gradients that the engine left apart (tied copies on pipeline stages); a no-op here."""

    def clip_grad_norm(self, params: list, max_norm: float) -> float:
        """The global gradient norm (clipped to `max_norm` when it is positive). Parameters may mix
        DTensors (FSDP2 shards, tensor-parallel pieces) and plain tensors: then engine/norms.py
        counts each element once over the `norm_ranks` ranks that hold the model."""
        if self.norm_ranks:
            return clip_by(params, max_norm, global_norm(params, self.norm_ranks))
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        if isinstance(norm, torch.distributed.tensor.DTensor):  # under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    def flush(self) -> None:
        """Nothing is ever under way after `update` here."""

    # -- checkpoints and memory ----------------------------------------------------------------
    def state_options(self) -> StateDictOptions:
        return StateDictOptions()

    def checkpoint_state(self, loading: bool = False) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.state_options())
        return {"model": self.saved_model(model_sd), "optim": optim_sd}

    def loading(self, saved: Mapping) -> Loading:
        return Loading(self.checkpoint_state(loading=True))

    def after_load(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self.load_options())

    def saved_model(self, model_sd: dict) -> dict:
        """The model's part of a checkpoint, for every engine: all of `model_sd`, or only the trainable
        parameters where the frozen ones are not saved (a LoRA base: megabytes saved, not the model's
        gigabytes; bnb's 4-bit layers' quantisation state, extra keys, goes with them)."""
        if self.frozen_in_checkpoints:
            return model_sd
        trained = {n for n, p in self.module.named_parameters(remove_duplicate=False) if p.requires_grad}
        return {k: v for k, v in model_sd.items() if k in trained}

    def load_options(self) -> StateDictOptions:
        """`state_options` for loading: a checkpoint without the frozen parameters loads only what it holds."""
        return dataclasses.replace(self.state_options(), strict=self.frozen_in_checkpoints)

    def memory_tensors(self) -> dict[str, Iterable]:
        params = list(self.model.parameters())
        states = [v for st in self.optimizer.state.values() for v in st.values()] if self.optimizer else []
        return {"params": params, "grads": [p.grad for p in params], "optimizer": states}
