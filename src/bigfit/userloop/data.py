"""The user's batches over the data-parallel ranks: a DataLoader of this rank's part of a dataset
(`loader`), a user's DataLoader re-made over it (`shard`), or this rank's rows of a global batch
(`split`). Tensor- and pipeline-parallel peers read the same part (the Runtime's data view,
layout/mesh.py), as in `bigfit train`."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..common.distributed import Runtime
from ..errors import BigfitError


class EpochSampler(DistributedSampler):
    """DistributedSampler that moves to the next epoch at each pass, so a loop that never calls
    set_epoch still reshuffles (the same order on every rank, from `seed`)."""

    def __iter__(self):
        order = super().__iter__()
        self.set_epoch(self.epoch + 1)
        return order


def loader(dataset, batch_size: int, data: Runtime, *, seed: int = 0, shuffle: bool = True,
           drop_last: bool = True, **kw) -> DataLoader:
    """A DataLoader of `batch_size` samples a step on this rank, over its part of `dataset`; `kw` goes
    to DataLoader (collate_fn, num_workers, ...). drop_last: every rank takes the same number of steps."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise BigfitError(f"engine.loader(batch_size={batch_size!r}): give the samples each rank takes a step, "
                          "a positive integer")
    if "sampler" in kw or "batch_sampler" in kw:
        raise BigfitError("engine.loader(): the sampler is the engine's (this rank's part of the dataset); "
                          "drop sampler= / batch_sampler=")
    sampler = EpochSampler(dataset, num_replicas=data.world_size, rank=data.rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kw)


def shard(dataloader: DataLoader, data: Runtime, *, seed: int = 0) -> DataLoader:
    """`dataloader` re-made over this rank's part of its dataset: its batch size, collate_fn, workers
    and pinning kept; shuffled when it was (a RandomSampler)."""
    if not isinstance(dataloader, DataLoader):
        raise BigfitError(f"engine.shard() takes a torch DataLoader, not {type(dataloader).__name__}; "
                          "engine.loader(dataset, batch_size) makes one")
    if dataloader.batch_size is None:
        raise BigfitError("engine.shard(): the DataLoader has a batch_sampler of its own; give engine.loader "
                          "the dataset and a batch size instead")
    shuffle = isinstance(dataloader.sampler, torch.utils.data.RandomSampler)
    return loader(dataloader.dataset, dataloader.batch_size, data, seed=seed, shuffle=shuffle,
                  drop_last=dataloader.drop_last or data.world_size > 1, collate_fn=dataloader.collate_fn,
                  num_workers=dataloader.num_workers, pin_memory=dataloader.pin_memory)


def split(batch: dict, data: Runtime, device: torch.device) -> dict:
    """This rank's contiguous rows of a global batch's tensors (rank r of n takes rows r*b/n to
    (r+1)*b/n), on `device`; other values as they are."""
    rows = {int(v.shape[0]) for v in batch.values() if torch.is_tensor(v) and v.dim() > 0}
    if len(rows) != 1 or next(iter(rows)) % data.world_size:
        raise BigfitError(f"engine.split(): the batch's tensors must share one row count divisible by the "
                          f"{data.world_size} data-parallel ranks; got rows {sorted(rows)}")
    each = next(iter(rows)) // data.world_size
    part = slice(data.rank * each, (data.rank + 1) * each)
    return {k: v[part].to(device, non_blocking=True) if torch.is_tensor(v) and v.dim() > 0 else v
            for k, v in batch.items()}
