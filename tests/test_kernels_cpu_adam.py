"""bigfit's host Adam kernel (kernels/cpu_adam.py) against torch's optimizers, and the offload
engine's choice of gradient dtype around it."""
import os

import pytest
import torch

from bigfit.kernels import cpu_adam

needs_kernel = pytest.mark.skipif(cpu_adam.kernel() is None, reason="no C compiler here to build the kernel")


@needs_kernel
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernel_steps_like_torch(cls, grad_dtype):
    """Five steps with a loss scale of 4, an odd length (the vector loop's tail) and every
    hyperparameter off its default: within rounding of torch's fused step fed the same (widened)
    gradients; a step size's worth (lr = 0.05) of difference would be a wrong formula."""
    torch.manual_seed(0)
    n = 1_000_003
    kw = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    ref = torch.randn(n)
    ours = ref.clone()
    ref_opt, our_opt = cls([ref], fused=True, **kw), cls([ours], fused=True, **kw)
    our_opt.state[ours] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    for _ in range(5):
        grad = (torch.randn(n) * 4).to(grad_dtype)
        ref.grad, ref_opt.grad_scale = grad.float().clone(), torch.tensor(4.0)  # torch unscales it in place
        ref_opt.step()
        cpu_adam.step(our_opt, ours, grad, 4.0)
    # The kernel rounds every operation (-ffp-contract=off: statefmt.py's reference matches it bit for
    # bit); torch's fused step fuses some multiply-adds. Worst seen: 5 of 1M weights 1.3e-5 apart (Adam's
    # L2 term), the rest within 1e-6.
    for got, want, close in [(ours, ref, 1e-6)] + [(our_opt.state[ours][k], ref_opt.state[ref][k], 1e-7)
                                                    for k in ("exp_avg", "exp_avg_sq")]:
        off = (got - want).abs() > close + 1e-6 * want.abs()
        assert off.float().mean() < 1e-4 and (got - want).abs().max() < 1e-4, (off.sum(), (got - want).abs().max())
    assert float(our_opt.state[ours]["step"]) == 5


def test_kernel_takes_only_what_it_implements():
    opt = torch.optim.AdamW([torch.zeros(3)], amsgrad=True)
    assert not cpu_adam.supports(opt)
    assert not cpu_adam.supports(torch.optim.SGD([torch.zeros(3)], lr=0.1))


def _engine(compute, monkeypatch, kernel: bool, grads_on_device=False):
    from bigfit.common.distributed import Runtime
    from bigfit.offload.strategy import apply_offload

    if not kernel:
        monkeypatch.setattr(cpu_adam, "supports", lambda inner: False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    applied = apply_offload(model, "zero2-offload", Runtime(0, 1, 0, torch.device("cpu")), compute, delayed=False,
                            nvme_dir=None, grads_on_device=grads_on_device)
    applied.attach_optimizer(torch.optim.AdamW, lr=0.01, fused=True)
    return model, applied.engine


@needs_kernel
@pytest.mark.parametrize("grads_on_device", [False, True])
def test_bf16_gradients_travel_in_bf16_with_the_kernel(monkeypatch, grads_on_device):
    """bf16 compute and the kernel: host gradient buffers (or slots) in bf16, and a step still lands."""
    model, opt = _engine(torch.bfloat16, monkeypatch, kernel=True, grads_on_device=grads_on_device)
    held = [s for s in opt.slots.slots] if grads_on_device else opt.grad_buffers
    assert opt.kernel and opt.grad_dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in held)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    opt.clip_and_step(1.0)
    opt.flush()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_without_the_kernel_gradients_stay_fp32(monkeypatch):
    _, opt = _engine(torch.bfloat16, monkeypatch, kernel=False)
    assert not opt.kernel and all(t.dtype == torch.float32 for t in opt.grad_buffers)


def test_build_failure_means_torch_step(monkeypatch, tmp_path):
    """No compiler (or a failing one): no kernel, no exception; the engine falls back to torch."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("BIGFIT_CACHE", str(tmp_path))
    cpu_adam.library.cache_clear()
    try:
        assert cpu_adam.kernel() is None
        monkeypatch.setenv("BIGFIT_CPU_ADAM", "0")
        monkeypatch.delenv("CC")
        cpu_adam.library.cache_clear()
        assert cpu_adam.kernel() is None
    finally:
        cpu_adam.library.cache_clear()


def test_host_step_threads_are_the_ranks_share_of_the_cores(monkeypatch):
    """torchrun's OMP_NUM_THREADS=1 does not decide it; pinned ranks keep their own cores."""
    from bigfit.common.distributed import cores_per_rank

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert cores_per_rank() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cores_per_rank() == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cores_per_rank() == 16  # taskset or a launcher already gave this rank its cores
