"""bigfit.hf: a Hugging Face Trainer or TRL trainer on bigfit's strategies (userloop/hf.py).

    import bigfit.hf
    bigfit.hf.use(trainer, strategy="zero2-offload")   # after the trainer is built, before train()
"""
from .userloop.hf import use

__all__ = ["use"]
