"""zero3-offload's host optimizer streamed per FSDP2 unit under backward (data_parallel/streamed.py)
gives the same iterates as FSDP2's after-backward step. Here on one rank, in this process; `_both`
also runs on more (tests.dist.run_ranks(_both, 2): bit for bit on torch 2.13, not in the suite to
save a 2-process launch); test_parity.py holds 2 ranks of it through the training loop to `single`."""
from __future__ import annotations


def _model():
    import torch

    class Block(torch.nn.Module):
        def __init__(self, unused: bool):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.spare = torch.nn.Linear(8, 8) if unused else None  # never called: this unit never completes

        def forward(self, x):
            return torch.tanh(self.fc(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 8)
            self.body = torch.nn.ModuleList([Block(unused=i == 0) for i in range(3)])
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x):
            x = self.inp(x)
            for block in self.body:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def _train(streamed: bool, steps: int = 4, micro: int = 2):
    """Losses, gradient norms and full parameters after `steps` steps of `micro` micro-batches
    (gradient accumulation), the learning rate changing every step, as training/step.py's `_update`."""
    import threading

    import torch
    import torch.distributed as dist

    from bigfit.common.distributed import Runtime
    from bigfit.parallel import plan_for
    from bigfit.layout.mesh import with_mesh
    from bigfit.data_parallel.sharding import apply_fsdp
    from bigfit.data_parallel.streamed import stream_host_steps

    rank, world = dist.get_rank(), dist.get_world_size()
    plan = plan_for("zero3-offload", world)
    rt = with_mesh(Runtime(rank, world, rank, torch.device("cpu")), plan)
    model = _model()
    applied = apply_fsdp(model, plan, rt, None, torch.float32)
    if streamed:
        applied = stream_host_steps(applied, rt.device)
    applied.attach_optimizer(torch.optim.AdamW, lr=0.05, weight_decay=0.1, fused=True)
    opt = applied.optimizer
    threads = []  # where each unit's streamed step ran
    for inner in getattr(applied, "steps", None) and applied.steps.inners or []:
        inner.register_step_post_hook(lambda *_: threads.append(threading.current_thread()))
    data = torch.randn(steps, micro, world, 3, 4, generator=torch.Generator().manual_seed(1))
    losses, norms = [], []
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = 0.05 / (t + 1)
        for i in range(micro):
            with applied.accumulation_context(sync=i == micro - 1):
                loss = applied.model(data[t, i, rank]).pow(2).mean()
                loss.backward()
            losses.append(loss.item())
        applied.finish_backward()
        norms.append(applied.clip_grad_norm([p for p in model.parameters() if p.grad is not None], 0.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if streamed:
        assert sorted(len(u) for u in applied.steps.units) == [2, 2, 4, 4]  # fc; fc + spare; inp + head
        # root and blocks 1, 2 on the host thread; block 0 (its spare got no gradient) by opt.step()
        assert len(threads) == 3 * steps and threading.main_thread() not in threads
    return losses, norms, full


def _both():
    """Compared here: tensors do not travel back through run_ranks' queue."""
    (losses, norms, params), (s_losses, s_norms, s_params) = _train(False), _train(True)
    return losses, s_losses, norms, s_norms, [n for n, p in params.items() if not s_params[n].equal(p)]


def _one_rank():
    """In this process, on the in-memory one-rank group that FSDP2 offloading uses (no spawn)."""
    from bigfit.common.distributed import init_runtime, shutdown

    rt = init_runtime(group_for_one=True)
    try:
        return _both()
    finally:
        shutdown(rt)


def test_streamed_host_step_matches_the_after_backward_step():
    losses, s_losses, norms, s_norms, differ = _one_rank()
    # the same fused AdamW kernel on the same gradients, one unit at a time: bit for bit
    assert s_losses == losses and s_norms == norms and differ == []
    assert len(losses) == 8 and losses[-1] != losses[1]  # it trained
