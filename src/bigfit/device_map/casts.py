"""Autocast's weight casts made once per chunked step, not once per micro-batch (`cast_once`).

Each micro-batch of a chunked run is a call on a thread of its own (schedule.py), each in its own
autocast region. Autocast's cache of weight casts is one for the process, but any thread that leaves
its outermost autocast region empties it (torch 2.13, tested in the test suite's counts): micro-batches
share the casts of the ones before them only until the first call ends, and then cast again (2 to
2.7 casts per weight per step at 4 chunks on the tiny T5s). On the host stage of a T5-large split that is
~400M parameters per cast, and each cast is kept alive until backward. Worse, a cast shared that way
is one autograd node, so some weights' micro-batch gradients were summed in bf16 and others in fp32,
depending on the schedule.

`cast_once(model)` lends each module whose forward is one op autocast runs in low precision (nn.Linear,
the convolutions, transformers' Conv1D) one shared cast of its weight and bias:
- only inside that module's own forward: a pre-hook puts the cast into `module._parameters`, a
  post-hook puts the Parameter back. Code outside it that reads the weight sees the Parameter as
  always (T5's feed-forward casts its input to `wo.weight.dtype`, a Hugging Face model's `dtype` is
  its first parameter's), and so does a tied use elsewhere (T5's embedding shares `lm_head`'s weight);
- only where autocast would cast it, decided at the call on the calling thread: autocast enabled for
  the weight's device type, the weight floating point, not float64 and not already autocast's dtype
  (so a Linear inside `autocast(enabled=False)` is left alone, as autocast leaves it);
- cast at its first use, on the thread and CUDA stream that uses it, under no_grad.
Each use gets its own `_Use` node, so weight gradients are summed in fp32 (see `_Use`).
"""
from __future__ import annotations

import torch
from torch import nn

_TYPES = ("cuda", "cpu")  # the autocast device types bigfit places on


def _forwards() -> set:
    """Forwards that hand their weight and bias straight to one op on autocast's lower-precision list
    (linear, addmm, conv, conv_transpose). Matched by forward, not by class: a subclass with a forward
    of its own may use its weight otherwise."""
    classes = [nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d]
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's: addmm(bias, x, weight)

        classes.append(Conv1D)
    except ImportError:
        pass
    return {c.forward for c in classes}


class _Use(torch.autograd.Function):
    """A module call's use of the shared casts of its trainable `params`: each gradient goes back to
    its parameter, in the parameter's dtype, from this use alone. Why not a differentiable cast
    shared by all uses: its one node would sum the micro-batches' bf16 weight gradients in bf16
    before the cast back (on the tiny test models, up to 7e-3 of a gradient's largest entry away from
    a cast per micro-batch). A node per use hands each gradient back in fp32 and autograd sums them
    in fp32: equal to one autocast region per micro-batch up to the order of that sum (1e-7, tested).
    The cost: a bf16 -> fp32 copy per use in backward, as autocast's own cast per micro-batch had."""

    @staticmethod
    def forward(ctx, casts: tuple, *params):
        ctx.dtypes = [p.dtype for p in params]
        return tuple(c.detach() for c in casts)  # new tensor objects on the same storage: no copy

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(g if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)))


def autocasting() -> bool:
    return any(torch.is_autocast_enabled(t) for t in _TYPES)


class cast_once:  # noqa: N801 (a context manager used like a function)
    """`with cast_once(model): run_chunks(...)`: each weight autocast would cast is cast once inside
    the `with`, not once per micro-batch. `enabled`: by default, whether autocast is on in this
    thread (where the micro-batches' calls enter autocast themselves, the caller says so); when off,
    nothing is hooked. On exit every hook is removed and every Parameter is back in its module."""

    def __init__(self, model: nn.Module, enabled: bool | None = None):
        self.model, self.enabled = model, autocasting() if enabled is None else enabled
        self.owners: dict[nn.Module, tuple[str, dict[str, nn.Parameter]]] = {}  # module -> (device type, lendable)
        self.plans: dict[tuple[nn.Module, torch.dtype], tuple] = {}  # what `_lend` puts in, per dtype
        self.casts: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # shared by tied parameters
        self.handles: list = []

    def __enter__(self) -> "cast_once":
        if not self.enabled:
            return self
        forwards = _forwards()
        for mod in self.model.modules():
            params = {n: p for n, p in mod._parameters.items() if n in ("weight", "bias") and _castable(p)}
            if type(mod).forward not in forwards or not params:
                continue
            self.owners[mod] = (next(iter(params.values())).device.type, params)
            self.handles.append(mod.register_forward_pre_hook(self._lend))  # after any earlier pre-hook
            # first, and even when the forward raises: the Parameters are back before anything else runs
            self.handles.append(mod.register_forward_hook(self._give_back, prepend=True, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        for mod, (_, params) in self.owners.items():
            mod._parameters.update(params)
        self.handles, self.owners, self.plans, self.casts = [], {}, {}, {}

    def _lend(self, module, args) -> None:
        """What autocast would make of the module's parameters in this call, from the shared casts.
        Runs for every call of every lendable module: kept to a few lookups."""
        kind = self.owners[module][0]
        if not torch.is_autocast_enabled(kind):
            return
        dtype = torch.get_autocast_dtype(kind)
        plan = self.plans.get((module, dtype)) or self._plan(module, dtype)
        names, params, casts, frozen = plan
        if names and torch.is_grad_enabled():  # one node for the call's weight and bias
            casts = _Use.apply(casts, *params)
        module._parameters.update(zip(names, casts))
        module._parameters.update(frozen)

    def _plan(self, module, dtype: torch.dtype) -> tuple:
        """(names, Parameters and casts of the trainable ones, {name: cast} of the frozen ones)."""
        lent = {n: p for n, p in self.owners[module][1].items() if p.dtype != dtype}
        trained = [n for n, p in lent.items() if p.requires_grad]
        plan = (trained, [lent[n] for n in trained], tuple(self._cast(lent[n], dtype) for n in trained),
                {n: self._cast(p, dtype) for n, p in lent.items() if n not in trained})
        self.plans[(module, dtype)] = plan
        return plan

    def _give_back(self, module, args, output) -> None:
        module._parameters.update(self.owners[module][1])

    def _cast(self, p: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        cast = self.casts.get((id(p), dtype))  # the owners keep `p` alive: its id stays its own
        if cast is None:
            with torch.no_grad():
                cast = self.casts[(id(p), dtype)] = p.to(dtype)
        return cast


def _castable(p) -> bool:
    """Autocast casts floating tensors other than float64, on the device types it covers."""
    return isinstance(p, nn.Parameter) and p.is_floating_point() and p.dtype != torch.float64 and p.device.type in _TYPES
