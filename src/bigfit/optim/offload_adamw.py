"""`OffloadAdamW`: AdamW whose fp32 master weights, moments and step live on the host, as a drop-in
`torch.optim.Optimizer`: any loop that calls `backward()`, `optimizer.step()` and `zero_grad()` (a
user's own, Hugging Face Trainer's `optimizers=(OffloadAdamW(...), None)`, Lightning's
`configure_optimizers`) keeps only the parameters (bf16, say) and one gradient at a time on the device.

How: each parameter's post-accumulate-grad hook copies its gradient to a host slot as backward makes
it (a side stream into pinned memory) and drops it from the device, so the copies overlap the rest of
backward; `step()` waits for the last copies, runs bigfit's host Adam kernel (kernels/cpu_adam.py) on
each parameter with its group's lr / betas / eps / weight_decay, read at every step (LR schedulers
and several groups work), and copies the masters back into the parameters, cast to their dtype.
`states`: the moments in fp32, bf16 or int8 (offload/statefmt.py: 12, 8, ~6 host bytes a parameter
with the master); `nvme_dir`: master and moments in files there (offload/nvme.py, a directory a group).

Beside the peers. torchao's `CPUOffloadOptimizer` wraps a torch optimizer the same way (hooks, pinned
copies, one CPU optimizer a parameter) and steps with torch's fused CPU AdamW: fp32 gradients and
states only, and with `offload_gradients=True` no gradient accumulation. DeepSpeed's `DeepSpeedCPUAdam`
is a fast host kernel (SIMD, OpenMP) that steps parameters already on the host: moving gradients down
and parameters up is its ZeRO-Offload engine's work (deepspeed.initialize). bigfit's own kernel is fused and multi-threaded with the GIL released, reads bf16
gradients as they come off the device (2 bytes a parameter, not 4), keeps bf16 or int8 moments, and
the NVMe tier keeps states larger than the RAM: this class is the offload engine's host step
(offload/engine.py, which also shards over ranks and places the model) for a loop that only hands out
its parameters.

Semantics beside torch.optim.AdamW (tests/test_optim_offload_adamw.py holds it to torch's numbers):
- `step()` consumes the gradients: after it every parameter's gradient is None, as if `zero_grad()`
  followed (Trainer calls only `model.zero_grad()`, which cannot reach the host slots). Several
  backward passes before a step sum, as torch's do; after `zero_grad(set_to_none=False)` a parameter
  that had a gradient and gets none from the next backward is stepped with zeros, as torch's would be.
- `param.grad` is None after backward: code that reads it (torch.nn.utils.clip_grad_norm_, so
  Trainer's `max_grad_norm`) sees no gradient. Clip here instead: `max_grad_norm=` (at every step), or
  `clip_grad_norm_(max_norm)` before `step()`; both divide the gradients inside the kernel (no pass of
  their own) and a non-finite norm skips the step. With Trainer: `TrainingArguments(max_grad_norm=0)`
  and `OffloadAdamW(..., max_grad_norm=1.0)`; Trainer then logs a grad_norm of 0, and the optimizer's
  `last_grad_norm` holds the real one.
- `delayed=True` (DeepSpeed's delayed parameter update): `step()` starts the host step on a thread and
  returns; its update lands in the parameters at the next `step()` (or `flush()`, which
  `state_dict()` calls), so forward and backward of step t see the parameters after update t-2, one
  update staler than without delay; gradients still apply to the latest masters. A parameter's
  gradient hook waits for the host step to have read its slot. A model saved without `flush()` is one
  update behind (Trainer saves the model before the optimizer: its checkpoints resume exactly all the
  same, since loading the optimizer's state puts its masters into the parameters).
- One process: several ranks (DDP reduces gradients after these hooks take them) and parameters
  sharded by FSDP / DeepSpeed are refused (checks.py); use bigfit.prepare's offload strategies there.
  fp16 with torch's GradScaler is not supported (it finds no gradients to unscale); use bf16.
"""
from __future__ import annotations

import atexit
import functools
import math
import threading
import weakref
from pathlib import Path

import torch

from ..engine.protocol import grad_hook
from ..errors import BigfitError
from ..kernels import cpu_adam
from ..offload import statefmt
from ..offload.nvme import NVMeStore
from ..offload.pinned import host_zeros
from . import stateio
from .checks import check_group, check_hyper, check_settings, check_single_process, check_trainable
from .hostparam import STEPPED, HostParam


def _groups(params) -> list[dict]:
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    return [{**g, "params": [g["params"]] if torch.is_tensor(g["params"]) else list(g["params"])} for g in groups]


class OffloadAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, states: str = "fp32", delayed: bool = False, nvme_dir=None,
                 max_grad_norm: float = 0.0):
        groups = _groups(params)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decoupled_weight_decay=True)
        check_settings(states, max_grad_norm)
        check_hyper(defaults)
        seen, first = set(), 0
        for g in groups:  # every refusal before any host memory is taken
            check_group(g, first, seen)
            first += len(g["params"])
        check_trainable([p for g in groups for p in g["params"]])
        check_single_process()
        self.states, self.delayed, self.max_grad_norm = states, delayed, max_grad_norm
        self.nvme_dir = Path(nvme_dir) if nvme_dir is not None else None
        self.kernel = cpu_adam.kernel() is not None
        self.last_grad_norm: float | None = None  # the norm of the last step's gradients, where one was computed
        self.skipped = False  # the last step was skipped: its gradients' norm was not finite
        self._host: dict[int, HostParam] = {}
        self._hooks, self._streams, self._lock = [], {}, threading.Lock()
        self._worker, self._error, self._landing, self._uploaded = None, None, [], []
        self._clip: tuple[float, float] | None = None  # (norm, coefficient) from clip_grad_norm_, for the step
        super().__init__(groups, defaults)
        atexit.register(_join_at_exit, weakref.ref(self))

    # -- building -------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """A group (also each of the constructor's): its trainable parameters get host state and a hook."""
        group = _groups([param_group])[0]
        first = sum(len(g["params"]) for g in self.param_groups)
        check_group(group, first, {id(p) for g in self.param_groups for p in g["params"]})
        self._land()
        super().add_param_group(group)
        trainable = [(i, p) for i, p in enumerate(group["params"], first) if p.requires_grad]
        store = NVMeStore(self.nvme_dir / f"group-{len(self.param_groups) - 1}", [p.numel() for _, p in trainable],
                          0, statefmt.bytes_per_parameter(self.states)) if self.nvme_dir and trainable else None
        for k, (i, p) in enumerate(trainable):
            pin = p.device.type == "cuda"
            zeros = functools.partial(store.tensor, k) if store else \
                lambda kind, n, dtype, pin=pin: host_zeros(n, dtype, pin and kind == "master")  # copied up: pinned
            self._host[id(p)] = HostParam(p, i, self.states, zeros, pin, self.kernel, self._lock)
            self._hooks.append(p.register_post_accumulate_grad_hook(grad_hook(self._on_grad)))

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._host[id(p)].take(p.grad, self._stream(p.device))
            p.grad = None  # the device keeps no gradient past its own backward

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def remove_hooks(self) -> None:
        """The parameters' gradient hooks off (pending updates landed first): gradients stay on them again."""
        self._land()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- the step -------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for hp in self._host.values():
            hp.clear(set_to_none)
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_single_process()
        self._land()
        work = self._work()
        scale = self._grad_scale([hp for hp, _ in work])
        if scale is None:  # a non-finite norm: the step is skipped, its gradients dropped
            for hp, _ in work:
                hp.clear(set_to_none=True)
            return loss
        for hp, _ in work:
            hp.begin()
            self.state[hp.param] = stateio.exposed(hp)
        self._landing = [hp for hp, _ in work]
        if self.delayed:
            self._worker = threading.Thread(target=self._host_step, args=(work, scale), daemon=True,
                                            name="OffloadAdamW's host step")
            self._worker.start()
        else:
            self._host_step(work, scale)
            self._land()
        return loss

    def _work(self) -> list[tuple[HostParam, dict]]:
        """(host parameter, its group's coefficients) for each parameter with a gradient, copies landed."""
        work, i = [], 0
        for group in self.param_groups:
            hyper = {"lr": float(group["lr"]), "betas": tuple(float(b) for b in group["betas"]),
                     "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
                     "decoupled_weight_decay": True}
            for p in group["params"]:
                hp = self._host.get(id(p))
                if hp is None and p.grad is not None:
                    raise BigfitError(f"OffloadAdamW: parameter {i} has a gradient but required no grad when the "
                                      "optimizer was made; make OffloadAdamW after unfreezing it")
                if hp is not None and hp.landed() is not None:
                    work.append((hp, hyper))
                i += 1
        return work

    def _host_step(self, work: list, scale: float) -> None:
        done = 0
        try:
            for event in self._uploaded:  # the last copies up have read the masters this step rewrites
                event.synchronize()
            for hp, hyper in work:
                hp.step(hyper, scale)
                done += 1
        except BaseException as e:  # re-raised on the training thread by `_land`
            self._error = e
        finally:
            for hp, _ in work[done:]:  # never stepped (an error): their hooks must not wait forever
                with self._lock:
                    if not hp.free.is_set():
                        hp.held, hp.after = hp.after, STEPPED
                        hp.free.set()

    def _land(self) -> None:
        """The host step ended (its error raised) and its updates copied into the parameters."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        if self._error is not None:
            error, self._error = self._error, None
            self._landing = []
            raise RuntimeError("OffloadAdamW's host step failed") from error
        for hp in self._landing:
            hp.upload()
        self._uploaded = [torch.cuda.current_stream(d).record_event() for d in {hp.param.device for hp in
                                                                                 self._landing} if d.type == "cuda"]
        self._landing = []

    def flush(self) -> None:
        """Land a pending update (delayed mode) in the parameters: before evaluation, saving the model, the end."""
        self._land()

    # -- clipping -------------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The total 2-norm of the gradients in the host slots, returned as torch.nn.utils.clip_grad_norm_
        does; the next `step()` scales the gradients by min(1, max_norm / (norm + 1e-6)), inside the kernel."""
        if float(norm_type) != 2.0:
            raise BigfitError(f"OffloadAdamW.clip_grad_norm_: norm_type {norm_type!r} is not supported; it clips by "
                              "the 2-norm (norm_type=2)")
        norm = self._norm(list(self._host.values()))
        self._clip = (norm, min(1.0, max_norm / (norm + 1e-6)))
        return torch.tensor(norm)

    def _norm(self, hps: list[HostParam]) -> float:
        return math.sqrt(sum(hp.sq_norm() for hp in hps))

    def _grad_scale(self, hps: list[HostParam]) -> float | None:
        """What the kernel divides the gradients by (1 / the clipping coefficient), None to skip the step."""
        clip, self._clip = self._clip, None
        if clip is None and self.max_grad_norm > 0:
            norm = self._norm(hps)
            clip = (norm, min(1.0, self.max_grad_norm / (norm + 1e-6)))
        if clip is not None:
            self.last_grad_norm = clip[0]
        self.skipped = clip is not None and not (math.isfinite(clip[0]) and clip[1] > 0)
        return None if self.skipped else 1.0 / clip[1] if clip is not None else 1.0

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's layout (stateio.py): per stepped parameter, by its index over the groups, its live
        host tensors ("step", "master", the moments), and the groups' hyperparameters. A pending update
        (delayed mode) lands first, so the checkpoint's masters and the parameters agree."""
        self._land()
        return stateio.pack(self.param_groups, self.state)

    def load_state_dict(self, state_dict: dict) -> None:
        """A state of this optimizer (any `states` format, converted where it differs) or of
        torch.optim.AdamW; the parameters take the loaded masters' values."""
        self._land()
        for hp in stateio.unpack(self.param_groups, self._host, state_dict):
            self.state[hp.param] = stateio.exposed(hp)
        self._uploaded = [torch.cuda.current_stream(d).record_event() for d in
                          {hp.param.device for hp in self._host.values()} if d.type == "cuda"]


def _join_at_exit(ref) -> None:
    """A daemon host step still inside torch when the interpreter exits aborts the process: end it first."""
    opt = ref()
    if opt is not None and opt._worker is not None:
        opt._worker.join(60.0)
