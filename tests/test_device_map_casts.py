"""Chunked steps under autocast cast each weight once per step (device_map/casts.py), not once per
micro-batch; gradients are those of a cast per micro-batch summed in fp32; the model is left as it was."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bigfit.device_map import cast_once, parallelize, pipeline, run_chunks, schedule, split_batch, train_step
from bigfit.device_map.casts import _forwards
from test_device_map import LAYOUTS, PLACES, batch, grads
from tiny import twin_models

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


class _CountCasts(TorchDispatchMode):
    """Casts of the model's parameters to bf16, by parameter id (modes are per thread: entered in each worker)."""

    def __init__(self, ids: set, seen: collections.Counter):
        super().__init__()
        self.ids, self.seen = ids, seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.ids and kwargs.get("dtype") == torch.bfloat16:
            self.seen[id(args[0])] += 1
        return func(*args, **kwargs)


def _counting(monkeypatch, model) -> collections.Counter:
    """Every micro-batch's thread counts the parameters' casts while it runs."""
    seen, ids, caller_state = collections.Counter(), {id(p) for p in model.parameters()}, schedule._caller_state

    def counted():
        enter = caller_state()
        return lambda stack: (enter(stack), stack.enter_context(_CountCasts(ids, seen)))
    monkeypatch.setattr(schedule, "_caller_state", counted)
    return seen


def _lendable(model) -> set:
    forwards = _forwards()
    return {id(p) for m in model.modules() if type(m).forward in forwards for p in (m.weight, m.bias) if p is not None}


def _off(got: dict, want: dict) -> float:
    """The largest difference, as a share of the largest entry of the same gradient."""
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)


def _snapshot(model):
    return ([(n, id(p), p.dtype, p.device, type(p)) for n, p in model.named_parameters(remove_duplicate=False)],
            [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()])


@pytest.mark.parametrize("layout", ["t5-split", "gpt2"])  # tied head and Linear; tied head and Conv1D
def test_chunked_autocast_casts_each_weight_once_with_fp32_gradient_sums(layout, monkeypatch):
    family, make = LAYOUTS[layout]
    ref, model = twin_models(family)
    parallelize(model, make(*PLACES[0]))
    b, chunks = batch(family), 4
    before = _snapshot(model)
    seen = _counting(monkeypatch, model)
    with torch.autocast(**BF16):
        monkeypatch.setattr(pipeline, "autocasting", lambda: False)  # as before casts.py
        train_step(model, b, chunks=chunks)
        assert max(seen.values()) > 1  # autocast's cache does not last the step
        seen.clear(), model.zero_grad(set_to_none=True), monkeypatch.undo()
        seen = _counting(monkeypatch, model)
        loss = train_step(model, b, chunks=chunks)
    assert set(seen) == _lendable(model) and set(seen.values()) == {1}  # every Linear / Conv1D weight, once
    assert _snapshot(model) == before  # the same Parameters, dtypes, devices and hooks
    parts = split_batch(b, chunks)
    share = [pipeline._target_tokens(ref, p) / pipeline._target_tokens(ref, b) for p in parts]
    seq = []
    for part in parts:  # one autocast region per micro-batch, on one thread: a cast per micro-batch
        with torch.autocast(**BF16):
            seq.append(ref(**part).loss)
    sum(l * s for l, s in zip(seq, share)).backward()
    per_micro_batch = grads(ref)
    assert _off(grads(model), per_micro_batch) < 1e-6  # summed in fp32 (a bf16 sum was 3e-3 to 8e-3 off)
    ref.zero_grad(set_to_none=True)
    with torch.autocast(**BF16):
        whole = ref(**b).loss
    whole.backward()
    torch.testing.assert_close(loss, whole.detach(), rtol=1e-3, atol=0)  # bf16 rounding per micro-batch
    assert _off(grads(model), grads(ref)) < 3e-2


def test_cast_once_leaves_the_model_as_it_was_when_the_forward_raises():
    _, model = twin_models("gpt2")
    parallelize(model, {"cpu": [0], "cpu:1": [1]})
    before = _snapshot(model)
    with cast_once(model) as c:
        assert not c.owners  # no autocast, nothing hooked
    lent = []

    def boom(module, args):
        lent.append(type(module.weight))
        raise ValueError("boom")
    parts = split_batch(batch("gpt2"), 3)
    with torch.autocast(**BF16), pytest.raises(ValueError, match="boom"):
        with cast_once(model):
            h = model.lm_head.register_forward_pre_hook(boom)  # after cast_once's: raised with the weight lent
            try:
                run_chunks(lambda p: model(**p).loss, parts, "cpu")
            finally:
                h.remove()
    assert lent == [torch.Tensor]
    assert _snapshot(model) == before and model.lm_head.weight is model.transformer.wte.weight
    lin, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    lin.weight.requires_grad_(False)  # frozen: cast without a gradient path
    with torch.autocast(**BF16):
        lin(x).float().sum().backward()
    expected, lin.bias.grad = lin.bias.grad, None
    with torch.autocast(**BF16), cast_once(lin):
        lin(x).float().sum().backward()
        with torch.autocast("cpu", enabled=False):  # where autocast casts nothing, nothing is lent
            torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=0, atol=0)
    assert lin.weight.grad is None and torch.equal(lin.bias.grad, expected)
