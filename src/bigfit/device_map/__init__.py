"""Device-map model parallelism: blocks placed on devices by a map, inputs moved by reversible hooks.

    from bigfit.device_map import parallelize, deparallelize
    parallelize(model, {"encoder": {"cuda:0": [0, 1, 2]}, "decoder": {"cpu": [0, 1, 2, 3, 4]}})
    parallelize(model, "auto", budgets={"cuda:0": "8GB", "cuda:1": "24GB", "cpu": "64GB"})
    loss = train_step(model, batch, chunks=4)      # GPipe micro-batches, every device busy
    model.generate(...)                            # greedy and beam search work as usual
    deparallelize(model)                           # hooks gone, the model on one device again

layout/maps.py parses and checks maps; planning/balance.py is the pure balancer behind "auto" and planning/automap.py feeds it
the planner's per-block bytes; hooks.py places the model; moves.py makes (and counts) every copy,
streams.py its CUDA streams and events; pipeline.py runs chunks on schedule.py's GPipe clock, and
casts.py casts each weight once per chunked step under autocast; strategy.py is `bigfit train
--strategy device_map`. docs/device_map.md.
"""
from ..layout.maps import DeviceMap, Stack, canonical_device, resolve_map
from .casts import cast_once
from .hooks import deparallelize, find_stacks, layout_of, parallelize
from .moves import CopyCount, count_copies
from .pipeline import run_chunks, split_batch, train_step

__all__ = ["CopyCount", "DeviceMap", "Stack", "canonical_device", "cast_once", "count_copies", "deparallelize",
           "find_stacks", "layout_of", "parallelize", "resolve_map", "run_chunks", "split_batch", "train_step"]
