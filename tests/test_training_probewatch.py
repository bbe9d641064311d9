"""Out of memory inside a probe step, recovered in the probe's own process: which errors count as out of
memory (torch's, cuBLAS's, cuDNN's), the injected ones, the deadline on a step that never ends after
one, and each engine left ready for the next size (torch's Adam half made, FSDP2 half way through a
step)."""
from __future__ import annotations

import threading

import pytest


def test_a_step_that_never_finishes_after_an_oom_ends_the_probe():
    from bigfit.training.probe import _deadline

    expired = threading.Event()
    with _deadline(0.05, expire=expired.set):
        assert expired.wait(10)  # the body would wait forever: the deadline fires
    finished = threading.Event()
    with _deadline(0.05, expire=finished.set):
        pass
    assert not finished.wait(0.2)  # cancelled once the body is done


def test_injected_oom_fires_above_the_threshold_only(monkeypatch):
    import torch

    from bigfit.common import faults

    monkeypatch.setenv("BIGFIT_FAULT", "oom-above:4")
    layer = torch.nn.Linear(2, 2)
    assert faults.inject_oom(layer, 4) is None
    handle = faults.inject_oom(layer, 5)
    with pytest.raises(torch.OutOfMemoryError):
        layer(torch.zeros(1, 2))
    handle.remove()
    layer(torch.zeros(1, 2))


def test_a_librarys_out_of_memory_counts_as_out_of_memory_and_nothing_else_does():
    import torch

    from bigfit.training.probefile import out_of_memory

    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not out_of_memory(ValueError("CUBLAS_STATUS_ALLOC_FAILED"))


def test_an_oom_inside_the_first_optimizer_step_leaves_no_half_made_state():
    """torch's Adam makes exp_avg before exp_avg_sq: an OOM between them left a state that the next
    probe step read as a KeyError (T5-large fp32 on an H200). The probe drops the states after an OOM."""
    import torch

    from bigfit.engine.protocol import Applied

    model = torch.nn.Linear(4, 4)
    engine = Applied(model=model, module=model, strategy="single")
    engine.attach_optimizer(torch.optim.Adam, lr=0.0)
    half = engine.optimizer.state[model.weight]
    half.update(step=torch.tensor(0.0), exp_avg=torch.zeros(4, 4))  # where the OOM struck
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(KeyError):
        engine.optimizer.step()
    engine.recover_from_oom()
    engine.optimizer.step()  # made again, whole
    assert set(engine.optimizer.state[model.weight]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("where", ["backward", "forward"])
def test_zero3_recovers_in_place_from_out_of_memory_half_way_through_a_step(where):
    """The units a failed step reached are sharded again, and the next steps' gradients are all
    sharded (2 gloo ranks, FSDP2, an error in the second unit's backward or forward)."""
    from dist import run_ranks

    assert run_ranks(_fails_then_steps, 2, where) == [["DTensor"] * 8] * 2


def _fails_then_steps(where: str) -> list[str]:
    import torch
    from torch.distributed.fsdp import fully_shard

    from bigfit.data_parallel.sharding import FSDPApplied

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(4)])
    for unit in model:
        fully_shard(unit)
    fully_shard(model)
    engine = FSDPApplied(model=model, module=model, strategy="zero3")
    engine.optimizer = torch.optim.AdamW(model.parameters())
    hook = model[1].register_full_backward_hook if where == "backward" else model[1].register_forward_hook
    fail = hook(lambda *_: _raise())
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        model(torch.randn(4, 8)).sum().backward()
    fail.remove()
    engine.reshard()
    engine.recover_from_oom()
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # mixed gradients fail here
        kinds = [type(p.grad).__name__ for p in model.parameters()]
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    return kinds


def _raise():
    raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)` (injected)")
