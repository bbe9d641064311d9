"""Pipeline parallelism across processes (`--strategy pipeline`), on torch.distributed.pipelining.

cut.py decides where the model is cut (pure: block sizes in, runs of blocks out); split.py decides
which stage owns which module and prunes a model to one rank's stages, keeping parameter names;
stage.py runs one stage as the model's own forward restricted to its blocks; runner.py drives the
schedules (GPipe, 1F1B, interleaved 1F1B) for the training loop and keeps tied copies in step;
strategy.py is the split step of `strategies.apply_strategy`. docs/pipeline.md.
"""
from .cut import SCHEDULES, PipelineLayout, balance
from .strategy import apply_pipeline, check

__all__ = ["SCHEDULES", "PipelineLayout", "apply_pipeline", "balance", "check"]
