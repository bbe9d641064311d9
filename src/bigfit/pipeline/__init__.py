"""Pipeline parallelism across processes (`--pp N`, `--strategy pipeline`), on torch.distributed.pipelining.

layout/cut.py decides where the model is cut (pure: block sizes in, runs of blocks out); layout/split.py decides
which stage owns which module and prunes a model to one rank's stages, keeping parameter names;
stage.py runs one stage as the model's own forward restricted to its blocks; runner.py drives the
schedules (GPipe, 1F1B, interleaved 1F1B) for the training loop and keeps tied copies in step;
strategy.py is the split step of parallel/apply.py. docs/pipeline.md. Only the pure layout is
imported here: the rest loads torch's distributed packages.
"""
from ..layout.cut import SCHEDULES, PipelineLayout, balance

__all__ = ["SCHEDULES", "PipelineLayout", "balance"]
