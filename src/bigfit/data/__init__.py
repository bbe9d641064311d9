"""Data: the embedded task, user files, tokenization and the layout-independent batch order."""
from .batches import Batcher, collate
from .files import read_examples
from .tasks import digits_task
from .tokenize import Dataset, build_dataset

__all__ = ["Batcher", "Dataset", "build_dataset", "collate", "digits_task", "read_examples"]
