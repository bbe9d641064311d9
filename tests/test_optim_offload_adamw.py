"""bigfit.optim.OffloadAdamW in a plain loop: torch.optim.AdamW's numbers (fp32 states; bf16 and int8
close), gradient accumulation, groups under an LR scheduler, clipping, the delayed update's lag, exact
resumes through torch.save'd state dicts, NVMe files, and its refusals. A tiny Llama on the CPU."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import AutoModelForCausalLM

from bigfit.errors import BigfitError
from bigfit.optim import OffloadAdamW
from dist import run_ranks
from tiny import tiny_config

STEPS = 6
# bigfit's fp32 kernel against torch.optim.AdamW (single-tensor path): each operation rounds as torch's
# (-ffp-contract=off), but the kernel's coefficients are rounded to float once where torch keeps some in
# double, so they part by an ulp or two a step. Measured: 1.2e-7 largest parameter difference after 6
# steps at lr 1e-3 (weights ~0.02), with accumulation, groups and clipping alike; with transformers 5.25's
# tiny Llama (2026-12-08) the groups under a scheduler with clipping part by 2.6e-6 (the same on the tree
# before any change of that day): Adam divides by sqrt(v), so a parameter whose gradient is near zero turns
# an ulp of it into a visible step.
FP32_ATOL = 5e-6
# bf16 moments (stochastic rounding) and int8 moments (block-scaled 8-bit codes) against fp32 AdamW after
# 6 steps at lr 1e-3: measured 2.0e-5 (bf16) and 2.3e-4 (int8) largest difference; an update is ~1e-3.
COMPACT_ATOL = {"bf16": 1e-4, "int8": 1e-3}


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).to(dtype)


def _batches(n: int, micro: int = 1):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(2, 384, (2, 12), generator=g) for _ in range(micro)] for _ in range(n)]


def _train(model, opt, batches, scheduler=None, clip: float = 0.0, start: int = 0) -> None:
    for step in batches[start:]:
        for ids in step:
            (model(input_ids=ids, labels=ids).loss / len(step)).backward()
        if clip and not isinstance(opt, OffloadAdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _diff(a, b) -> float:
    return max((p.float() - q.float()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _groups(model, lr):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1, "lr": lr}, {"params": rest, "weight_decay": 0.0, "lr": lr * 3}]


@pytest.mark.parametrize("micro", [1, 2])
def test_matches_torch_adamw(micro):
    """A plain loop, with and without two accumulated micro-batches a step."""
    ref, mine, batches = _model(), _model(), _batches(STEPS, micro)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01), batches)
    _train(mine, OffloadAdamW(mine.parameters(), lr=1e-3, weight_decay=0.01), batches)
    assert _diff(ref, mine) < FP32_ATOL
    assert all(p.grad is None for p in mine.parameters())  # nothing left on the "device"


def test_groups_under_a_scheduler_and_clipping():
    """Trainer's decay / no-decay groups with their own lr, LambdaLR editing them, clipping by norm 0.5."""
    ref, mine, batches = _model(), _model(), _batches(STEPS)
    warm = lambda s: (s + 1) / 3  # noqa: E731
    opt = torch.optim.AdamW(_groups(ref, 1e-3))
    _train(ref, opt, batches, torch.optim.lr_scheduler.LambdaLR(opt, warm), clip=0.5)
    off = OffloadAdamW(_groups(mine, 1e-3), max_grad_norm=0.5)
    _train(mine, off, batches, torch.optim.lr_scheduler.LambdaLR(off, warm))
    assert _diff(ref, mine) < FP32_ATOL
    assert off.param_groups[1]["lr"] == opt.param_groups[1]["lr"] and off.last_grad_norm > 0.5


def test_clip_grad_norm_method_returns_torchs_norm():
    ref, mine, ids = _model(), _model(), _batches(1)[0][0]
    for m in (ref, mine):
        m(input_ids=ids, labels=ids).loss.backward()
    off = OffloadAdamW(mine.parameters())  # hooks from the next backward on: take this one again
    mine.zero_grad()
    mine(input_ids=ids, labels=ids).loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert off.clip_grad_norm_(0.1).item() == pytest.approx(want.item(), rel=1e-5)


def test_zero_grad_to_zeros_steps_parameters_without_gradients():
    """zero_grad(set_to_none=False), then backward passes that miss a parameter: torch steps it with zeros
    (momentum and decay) where it had a gradient before, and never where it had none."""
    def run(cls):
        torch.manual_seed(0)
        used, once, never = (torch.nn.Linear(4, 4) for _ in range(3))
        opt = cls([*used.parameters(), *once.parameters(), *never.parameters()], lr=0.1, weight_decay=0.5)
        for i in range(3):
            opt.zero_grad(set_to_none=False)
            x = used(torch.ones(1, 4))
            (once(x) if i == 0 else x).sum().backward()
            opt.step()
        return torch.cat([m.weight.detach().flatten() for m in (used, once, never)])
    got, want = run(OffloadAdamW), run(torch.optim.AdamW)
    assert torch.allclose(got, want, atol=FP32_ATOL)


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_compact_states_stay_close(states):
    ref, mine, batches = _model(), _model(), _batches(STEPS)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), batches)
    _train(mine, OffloadAdamW(mine.parameters(), lr=1e-3, states=states), batches)
    assert _diff(ref, mine) < COMPACT_ATOL[states]


def test_delayed_update_lags_one_step():
    """Step t's forward and backward see the parameters after update t-2; its gradient updates the
    masters after t-1. The reference: torch's AdamW on a master copy, the model one update behind it."""
    model, master, batches = _model(), _model(), _batches(STEPS)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for (ids,) in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        before = [p.detach().clone() for p in master.parameters()]  # update t-1, which lands now
        for p, q in zip(master.parameters(), model.parameters()):
            p.grad, q.grad = q.grad, None
        opt.step()
        with torch.no_grad():
            for q, b in zip(model.parameters(), before):
                q.copy_(b)
    mine = _model()
    off = OffloadAdamW(mine.parameters(), lr=1e-3, delayed=True)
    _train(mine, off, batches)
    assert _diff(model, mine) < FP32_ATOL  # one update behind, as the reference's model
    off.flush()
    assert _diff(master, mine) < FP32_ATOL


@pytest.mark.parametrize("states,dtype", [("fp32", torch.float32), ("fp32", torch.bfloat16),
                                          ("bf16", torch.bfloat16), ("int8", torch.bfloat16)])
def test_state_dict_resumes_exactly(states, dtype):
    """Saved with torch.save after 3 steps, loaded (weights_only, as Trainer does) into a new optimizer on a
    fresh copy of the initial model: the next 3 steps give the uninterrupted run's parameters bit for bit.
    bf16 parameters resume exactly through the saved fp32 masters."""
    batches = _batches(STEPS)
    model = _model(dtype)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, states=states)
    _train(model, opt, batches[:3])
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    _train(model, opt, batches, start=3)
    fresh = _model(dtype)
    resumed = OffloadAdamW(fresh.parameters(), lr=1e-3, states=states)
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    _train(fresh, resumed, batches, start=3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    assert set(opt.state_dict()["state"][0]) >= {"step", "master"}


def test_loads_torch_adamw_state_and_other_formats():
    """A torch.optim.AdamW checkpoint resumes in OffloadAdamW; an fp32 one loads into int8 states."""
    batches = _batches(STEPS)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    _train(ref, opt, batches[:3])
    state = copy.deepcopy(opt.state_dict())
    mine = copy.deepcopy(ref)
    _train(ref, opt, batches, start=3)
    off = OffloadAdamW(mine.parameters(), lr=1e-3)
    off.load_state_dict(state)
    _train(mine, off, batches, start=3)
    assert _diff(ref, mine) < FP32_ATOL
    int8 = OffloadAdamW(copy.deepcopy(mine).parameters(), lr=1e-3, states="int8")
    int8.load_state_dict(off.state_dict())
    assert "exp_avg_codes" in int8.state_dict()["state"][0]


def test_states_in_files(tmp_path):
    ram, disk, batches = _model(), _model(), _batches(3)
    _train(ram, OffloadAdamW(ram.parameters(), lr=1e-3, states="bf16"), batches)
    _train(disk, OffloadAdamW(disk.parameters(), lr=1e-3, states="bf16", nvme_dir=tmp_path), batches)
    assert _diff(ram, disk) == 0
    assert len(list(tmp_path.glob("group-0/bucket-*-master.bin"))) == len(list(disk.parameters()))


@pytest.mark.parametrize("params,says", [
    ([], "empty parameter list"),
    ([torch.nn.Parameter(torch.ones(2), requires_grad=False)], "none requiring grad"),
    ([torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))], "not a real floating-point"),
    ([torch.nn.Parameter(torch.eye(2).to_sparse())], "sparse"),
    ([torch.nn.Parameter(torch.ones(2, device="meta"))], "meta device"),
])
def test_refusals(params, says):
    with pytest.raises(BigfitError, match=says):
        OffloadAdamW(params)


def test_refuses_bad_settings():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(BigfitError, match="states 'fp8' is not valid"):
        OffloadAdamW(p, states="fp8")
    with pytest.raises(BigfitError, match="betas"):
        OffloadAdamW(p, betas=(0.9, 1.5))


def test_refuses_sharded_parameters_and_several_ranks():
    assert run_ranks(_refusals_on_ranks, 2) == [["DTensor", "torch.distributed runs 2 ranks"]] * 2


def _refusals_on_ranks() -> list[str]:
    from torch.distributed.fsdp import fully_shard

    from bigfit.errors import BigfitError
    from bigfit.optim import OffloadAdamW

    found = []
    sharded = fully_shard(torch.nn.Linear(4, 4))
    for params in (sharded.parameters(), torch.nn.Linear(4, 4).parameters()):
        try:
            OffloadAdamW(params)
        except BigfitError as e:
            found.append("DTensor" if "DTensor" in str(e) else str(e).split(",")[0].removeprefix("OffloadAdamW: "))
    return found


def test_add_param_group():
    def run(cls):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        opt = cls(a.parameters(), lr=0.01)
        opt.add_param_group({"params": b.parameters(), "lr": 0.1, "weight_decay": 0.0})
        for _ in range(3):
            b(a(torch.ones(3, 4))).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().flatten() for p in (*a.parameters(), *b.parameters())])
    assert torch.allclose(run(OffloadAdamW), run(torch.optim.AdamW), atol=FP32_ATOL)


@pytest.mark.parametrize("delayed", [False, True])
def test_trainer_checkpoint_resumes_exactly(tmp_path, delayed):
    """Hugging Face Trainer with `optimizers=(OffloadAdamW(...), None)`: bf16 parameters, int8 states, two
    accumulated micro-batches, clipping by the optimizer (Trainer's own sees no gradients: max_grad_norm=0),
    a linear schedule. Resumed from the step-2 checkpoint, it ends on the uninterrupted run's parameters.
    Delayed: the checkpoint's state_dict() lands the pending update in both runs alike."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(2, 384, (16, 12), generator=g)]

    def run(out, resume=None):
        model = _model(torch.bfloat16)
        opt = OffloadAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, states="int8", delayed=delayed)
        args = TrainingArguments(out, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_grad_norm=0, save_steps=2, report_to=[], use_cpu=True, lr_scheduler_type="linear",
                                 warmup_steps=1, seed=0, data_seed=0, disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None)).train(resume_from_checkpoint=resume)
        opt.flush()
        return model, opt
    whole, opt = run(tmp_path / "whole")
    resumed, _ = run(tmp_path / "resumed", resume=tmp_path / "whole" / "checkpoint-2")
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters()))
    assert 0 < opt.last_grad_norm < 100 and _diff(whole, _model(torch.bfloat16)) > 0
