"""The offload engine's own mechanics. Its delayed update on two gloo ranks: each bucket's update is
copied up (and all-gathered) from the next backward's hook, which must give what one rank gives on the
whole batch, with gradients waiting in host buffers or on the device, in fp32 or (bf16 compute) bf16.
A step abandoned after an out-of-memory error, and the NVMe tier's check of its disk's room."""
import pytest
import torch

from dist import run_ranks
from tiny import Stack


def _train_delayed(x: torch.Tensor, grads: str = "host", compute: torch.dtype | None = None, steps: int = 4) -> dict:
    import torch.distributed as dist

    from bigfit.common.distributed import Runtime
    from bigfit.offload.strategy import apply_offload

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(0)
    model = Stack(width=5)
    applied = apply_offload(model, "zero2-offload", Runtime(rank, world, rank, torch.device("cpu")), compute,
                            delayed=True, nvme_dir=None, grads_on_device=grads == "device")
    applied.attach_optimizer(torch.optim.AdamW, lr=0.01, fused=True)
    opt = applied.engine
    losses = []
    for _ in range(steps):
        loss = model(x.chunk(world)[rank].to(compute or torch.float32)).float().pow(2).mean()  # the engine averages
        loss.backward()
        opt.clip_and_step(1.0)
        losses.append(loss.item())
    opt.flush()
    # plain lists: tensors would travel back as shared-memory handles that die with the rank's process
    return {"losses": losses, "params": {n: p.detach().float().tolist() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("grads", ["host", "device"])
@pytest.mark.parametrize("compute", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_ranks_match_one_on_the_whole_batch(grads, compute):
    """fp32 to 1e-6. bf16: the two ranks' gradients are averaged in fp32 and then rounded to bf16,
    one rank's are rounded directly, so the masters differ a little and their bf16 copies may round
    apart: 2 bf16 ulps at 0.5 (4e-3; a step's lag would move them by about lr, 1e-2), losses 1e-4."""
    torch.manual_seed(1)
    x = torch.randn(8, 5)
    one = _train_delayed(x, grads, compute)
    two = run_ranks(_train_delayed, 2, x, grads, compute)
    tol = dict(atol=1e-6, rtol=1e-5) if compute is None else dict(atol=4e-3, rtol=0.0)
    loss_tol = tol if compute is None else dict(atol=1e-4, rtol=0.0)
    assert one["losses"][-1] < one["losses"][0]  # it trained (and the lag did not stall it)
    for n, p in one["params"].items():  # every rank holds the whole, all-gathered parameters
        assert two[0]["params"][n] == two[1]["params"][n]
        torch.testing.assert_close(torch.tensor(two[0]["params"][n]), torch.tensor(p), **tol)
    mean = [(a + b) / 2 for a, b in zip(two[0]["losses"], two[1]["losses"])]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(one["losses"]), **loss_tol)


def _steps(x: torch.Tensor, fail_at: int | None) -> dict:
    """Three exact (clipped) offload steps on one process; `fail_at`: that step's first backward runs
    out of memory half-way (three of five buckets already sent down), then the engine recovers
    (micro-batch auto's probe) and the step runs again."""
    from bigfit.common.distributed import Runtime
    from bigfit.offload.strategy import apply_offload

    torch.manual_seed(0)
    model = Stack(width=5)
    applied = apply_offload(model, "zero2-offload", Runtime(0, 1, 0, torch.device("cpu")), None, delayed=False,
                            nvme_dir=None)
    applied.attach_optimizer(torch.optim.AdamW, lr=0.01, fused=True)

    def oom(*_):
        raise torch.OutOfMemoryError("injected half-way through backward")

    for step in range(3):
        if step == fail_at:
            handle = model.layers[1].register_full_backward_pre_hook(oom)
            with pytest.raises(torch.OutOfMemoryError):
                model(x).pow(2).mean().backward()
            handle.remove()
            assert applied.recovers_from_oom
            applied.recover_from_oom()
        model(x).pow(2).mean().backward()
        applied.engine.clip_and_step(1.0)
    applied.engine.flush()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_step_that_ran_out_of_memory_in_backward_is_abandoned_and_the_next_runs_exactly():
    """Without recovery the step after would wait forever for the buckets the failed backward sent
    down (their host gradients never stepped): run in a thread with a limit."""
    import threading

    x = torch.randn(6, 5)
    out = {}
    worker = threading.Thread(target=lambda: out.update(failed=_steps(x, 1)), daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "the step after the failed one never finished"
    for n, p in _steps(x, None).items():
        assert torch.equal(out["failed"][n], p), n


def test_the_nvme_tier_refuses_a_disk_that_cannot_hold_its_files(tmp_path, monkeypatch):
    """Sparse files on a disk too small end a job in SIGBUS mid-step: the store says so up front,
    counting the node's ranks (a directory each on the same disk) and an earlier run's files it replaces."""
    import os
    import shutil
    from collections import namedtuple

    from bigfit.errors import BigfitError
    from bigfit.offload.nvme import NVMeStore

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**9))  # 1 GB free
    sizes = [10**7] * 10  # 12 bytes an element: 120 MB a bucket, 1.2 GB in all
    with pytest.raises(BigfitError, match=r"--nvme-host-gb 0: zero2-offload-nvme would keep 1.2 GB .* 1.0 GB free; "
                                          r"keep 0.2 GB more in host RAM"):
        NVMeStore(tmp_path / "rank-0", sizes)
    NVMeStore(tmp_path / "rank-0", sizes, host_bytes=3 * 12 * 10**7)  # three buckets in RAM: 0.84 GB in files
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(BigfitError, match="would keep 1.7 GB"):  # two ranks' files on the same disk
        NVMeStore(tmp_path / "rank-1", sizes, host_bytes=3 * 12 * 10**7)
    with open(tmp_path / "rank-1" / "bucket-0009-master.bin", "wb") as f:  # an earlier run's file, 0.2 GB on disk
        os.posix_fallocate(f.fileno(), 0, 2 * 10**8)
    with pytest.raises(BigfitError, match="1.2 GB free"):  # made anew: its blocks come free
        NVMeStore(tmp_path / "rank-1", sizes, host_bytes=3 * 12 * 10**7)
