"""A run leaves nothing behind in its process: a notebook, `bigfit.api` or the tests' kept ranks run
job after job in one. The offload engines (their host buffers with them) go with the run, and so do
the process groups it made for itself (each gloo group holds three threads; an NCCL one device memory)."""
from __future__ import annotations

import contextlib
import gc
import io

from dist import run_ranks
from test_parity import job


def _engines() -> int:
    from bigfit.offload.engine import OffloadEngine
    from bigfit.data_parallel.streamed import StreamedSteps

    gc.collect()
    return sum(isinstance(o, (OffloadEngine, StreamedSteps)) for o in gc.get_objects())


def test_the_offload_engines_go_with_their_run(model_dirs, pairs_file, tmp_path):
    from dist import train

    before = _engines()
    for strategy in ("zero2-offload", "zero2-offload+noclip", "zero3-offload"):
        with contextlib.redirect_stdout(io.StringIO()):
            train(job(model_dirs["gpt2"], pairs_file, tmp_path / strategy, strategy, "fp32"))
        assert _engines() == before, strategy


def _runs_twice(model_dirs, data, root) -> list[tuple[int, int]]:
    """(threads, process groups) this rank gained over the second of two alike runs."""
    import os

    import torch.distributed as dist

    from dist import train

    def counts() -> tuple[int, int]:
        return len(os.listdir(f"/proc/{os.getpid()}/task")), len(dist.distributed_c10d._world.pg_map)

    seen = []  # the offload engine's two groups; T5's pipeline, a group for its tied embeddings' copies
    for i, (family, strategy) in enumerate([("gpt2", "zero2-offload")] * 2 + [("t5", "pipeline")] * 2):
        before = counts()
        train(job(model_dirs[family], data, root / f"{strategy}-{i}", strategy, "fp32"))
        seen.append(tuple(a - b for a, b in zip(counts(), before)))
    return seen[1::2]  # the first of each pair makes the layout's mesh, kept for the next


def test_the_groups_a_run_made_for_itself_end_with_it(model_dirs, pairs_file, tmp_path):
    for rank in run_ranks(_runs_twice, 2, model_dirs, pairs_file, tmp_path):
        assert rank == [(0, 0), (0, 0)], rank
