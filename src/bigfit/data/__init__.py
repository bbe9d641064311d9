"""Data: the embedded task, user files, tokenization and the layout-independent batch order."""
from .files import read_examples
from .tasks import digits_task

__all__ = ["Batcher", "Dataset", "build_dataset", "collate", "digits_task", "read_examples"]
_TORCH_USERS = {"Batcher": "batches", "collate": "batches", "Dataset": "tokenize", "build_dataset": "tokenize"}


def __getattr__(name: str):
    """The names whose modules import torch (1.1 s), on first use: the command's checks (cli.py, whose
    checks read data.columns) need none of them, so a mistake's one line comes before torch loads."""
    if name not in _TORCH_USERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_TORCH_USERS[name]}", __name__), name)
