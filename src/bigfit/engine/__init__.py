"""The engines a plan's transforms build (parallel/apply.py applies them in order): the plain one
and the protocol the loop talks to (protocol.py), FSDP2 and DDP + ZeRO-1 (data_parallel/sharding.py), the offload
engine (offload/engine.py and the modules it uses), zero3-offload's streamed host steps (data_parallel/streamed.py),
and the per-block transforms (checkpointing.py, compiling.py)."""
from __future__ import annotations

import torch

from .protocol import Applied, Engine, local

__all__ = ["Applied", "Engine", "build_optimizer", "local"]


def build_optimizer(engine: Engine, cfg) -> None:
    """AdamW (decoupled weight decay) or Adam (L2), placed where the engine keeps its states."""
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    # torch's fused kernels (CUDA and CPU): on the GPU machine the multi-tensor loop made the host-side
    # step of zero3-offload 4.5x slower than FSDP2's own offload with fused AdamW (benchmarks/RESULTS.md)
    engine.attach_optimizer(cls, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay, fused=True)
