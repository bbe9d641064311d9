"""What every engine shares: the protocol the loop talks to and the plain engine (protocol.py), the
per-block transforms (checkpointing.py, with actoffload.py's inputs in host RAM; compiling.py), the loss
(losses.py; chunkloss.py, the head's loss in chunks of tokens), norms over sharded
gradients (norms.py), measured model-state memory (memory.py), and the optimizer every engine attaches
(`build_optimizer`). The engines themselves are one package per dimension above this one
(data_parallel/, offload/, pipeline/, device_map/, with tensor/'s plans below the planner and context/
below this one), applied in
order by parallel/apply.py."""
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
