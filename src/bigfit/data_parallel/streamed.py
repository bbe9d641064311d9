"""zero3-offload's host optimizer streamed per FSDP2 unit (a block, then the root) under backward,
as the offload engine's eager mode: only without clipping and loss scaling, which would need the
global gradient norm before any step.

FSDP2 calls the post-accumulate-grad hooks of a unit's sharded parameters right after it gives
them their reduced host gradients (foreach_reduce, torch 2.11 and 2.13). When every trainable
parameter of a unit has its gradient, a host thread steps that unit with its own fused AdamW,
which shares the states (and hyperparameters) of the job's one optimizer, so checkpoints and the
loop see an ordinary torch optimizer. Why each read and write is safe:
- gradients: torch 2.11 copies them down with non_blocking (pinned); the hook records an event on
  the stream that copy went on (the current one inside the hook), which the host thread waits on.
  torch 2.13 copies synchronously when a parameter has such a hook: the event is then already done
  (and autograd's thread waits for each unit's reduce-scatter and copy, which 2.11 overlapped).
- parameters: the unit's host shards were last read by its all-gather for this backward, which
  its gradients depend on, so that event also orders the update after that read. The next
  forward's all-gathers read them after `finish_backward` has joined the host thread.
A unit whose parameters did not all get a gradient (unused ones) is left to the ordinary step.
After a step that failed (micro-batch auto's probe: an out-of-memory error in backward or in a unit's
step), the thread, which waits for units the failed backward never finished, is stopped and every
count made again (`StreamedFSDPApplied.recover_from_oom`).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from ..common import faults, waits
from ..engine.protocol import grad_hook, syncing
from .sharding import FSDPApplied, _units

RECOVERY_S = 120.0  # `stop`'s wait for the thread to end: longer than any one unit's step


class StreamedSteps:
    """The per-unit host steps of one optimizer, driven by FSDP2's gradient hooks."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device, self.sync = model, device, True
        self.units, self.inners, self.optimizer = [], [], None
        self._left, self._stepped, self._hooks = [], [], []
        self._worker, self._queue, self._error = None, None, None

    def attach(self, optimizer: torch.optim.Optimizer, cls, **kw) -> None:
        """`optimizer`: the job's, over every parameter. Units are read now, after materialisation
        (which may have replaced the parameters)."""
        self.optimizer, self.units = optimizer, _trainable_by_unit(self.model)
        self._unit_of = {id(p): i for i, ps in enumerate(self.units) for p in ps}
        self.inners = [cls(ps, **kw) for ps in self.units]
        self._left = [len(ps) for ps in self.units]
        self._hooks = [p.register_post_accumulate_grad_hook(grad_hook(self._on_grad)) for ps in self.units
                       for p in ps]
        self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def syncing(self, sync: bool):
        """Accumulation micro-batches (sync False): FSDP2 adds to the host gradients, no step yet."""
        return syncing(self, sync)

    # -- backward (autograd's thread) -------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        i = self._unit_of[id(p)]
        self._left[i] -= 1
        if self._left[i] == 0:
            # inside the hook the current stream is the one FSDP2 copied this unit's gradients on
            done = torch.accelerator.current_stream(self.device).record_event() if self.device.type != "cpu" else None
            if self._worker is None:
                self._start()
            self._queue.put((i, done))

    def _start(self) -> None:
        self._stepped = []
        self._queue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._steps, args=(self._queue,), daemon=True,
                                        name="zero3-offload's streamed host step")
        self._worker.start()

    @torch.no_grad()
    def _steps(self, todo: queue.SimpleQueue) -> None:
        hyper = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}  # lr set before backward
        try:
            while (item := _next(todo)) is not None:
                i, done = item
                if done is not None:
                    with waits.waiting(f"the copy down of unit {i}'s gradients"):
                        done.synchronize()
                faults.at("streamed")
                inner = self.inners[i]
                inner.state = self.optimizer.state  # loading a checkpoint replaces the dict: read it now
                inner.param_groups[0].update(hyper)
                inner.step()
                self._stepped.append([(p, p.grad) for p in self.units[i]])
        except BaseException as e:  # re-raised on the training thread
            self._error = e

    # -- after backward (the training thread) -----------------------------------------------------
    def join(self, timeout: float | None = None) -> None:
        """Every streamed step done: before the gradient norm, the job's step and the next forward. A
        RuntimeError where the thread has not ended within `timeout` s."""
        if self._worker is not None:
            self._queue.put(None)
            if not waits.join(self._worker, "zero3-offload's streamed host step", timeout):
                raise RuntimeError(f"zero3-offload's streamed host step did not end within {timeout:g} s: "
                                   f"{waits.now()}")
            self._worker = None
        self._left = [len(ps) for ps in self.units]
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the streamed host step of zero3-offload failed") from error

    def stop(self) -> None:
        """After a step that failed: the thread ended (its queue's end comes after what it holds), the
        error it met and the units it stepped forgotten (at the probe's lr 0 they changed nothing)."""
        try:
            self.join(waits.limit(RECOVERY_S))
        except RuntimeError:
            if self._worker is not None:  # still under way: the engine cannot go on
                raise
        self._stepped = []

    def _before_step(self, optimizer, args, kwargs) -> None:
        """The job's step then updates only what was not streamed: the gradients that the host
        thread applied (kept until now for the gradient norm) are set aside. Only those very
        tensors: after a skipped step, a later gradient is never mistaken for one."""
        self.join()
        for p, grad in (pair for unit in self._stepped for pair in unit):
            if p.grad is grad:
                p.grad = None
        self._stepped = []


def _next(todo: queue.SimpleQueue):
    with waits.waiting("the next unit whose gradients backward finishes"):
        return todo.get()


def _trainable_by_unit(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Each trainable parameter under its innermost FSDP2 unit (tied ones are one parameter)."""
    units = list(_units(model))  # the root first, blocks after: inner units overwrite
    owner = {}
    for i, unit in enumerate(units):
        owner.update({id(p): (i, p) for p in unit.parameters() if p.requires_grad})
    groups = [[p for j, p in owner.values() if j == i] for i in range(len(units))]
    return [g for g in groups if g]


@dataclass
class StreamedFSDPApplied(FSDPApplied):
    """zero3-offload without clipping or loss scaling: host steps under backward (module docstring)."""
    steps: StreamedSteps | None = None

    def accumulation_context(self, sync: bool):
        return self.steps.syncing(sync)

    def finish_backward(self) -> None:
        self.steps.join()  # the gradient norm follows: nothing may still be reading or writing

    def recover_from_oom(self) -> None:
        self.steps.stop()
        with self.steps.syncing(False):  # FSDP2's end-of-backward hands the units it reduces on: no step for them
            super().recover_from_oom()

    def attach_optimizer(self, cls, **kw) -> None:
        super().attach_optimizer(cls, **kw)
        self.steps.attach(self.optimizer, cls, **kw)


def stream_host_steps(applied: FSDPApplied, device: torch.device) -> StreamedFSDPApplied:
    notes = applied.notes + ["host optimizer streamed per unit under backward"]
    return StreamedFSDPApplied(model=applied.model, module=applied.module, strategy=applied.strategy,
                               notes=notes, steps=StreamedSteps(applied.model, device))
