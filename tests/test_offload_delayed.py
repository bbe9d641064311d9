"""The offload engine's delayed update on two gloo ranks: each bucket's update is copied up (and
all-gathered) from the next backward's hook, which must give what one rank gives on the whole batch,
with gradients waiting in host buffers or on the device, in fp32 or (bf16 compute) bf16."""
import pytest
import torch

from dist import run_ranks
from tiny import Stack


def _train_delayed(x: torch.Tensor, grads: str = "host", compute: torch.dtype | None = None, steps: int = 4) -> dict:
    import torch.distributed as dist

    from bigfit.distributed import Runtime
    from bigfit.strategies.offloading import apply_offload

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
