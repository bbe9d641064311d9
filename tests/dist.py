"""Run a function on N gloo ranks (separate processes) and report every failing rank's traceback.

The ranks are kept for the next call, to the end of the session: starting them (Python, then torch and
transformers imported) takes ~6 s on this machine, which each test file's fixture paid. A call gets new
ranks when it asks (`fresh`), when the environment is not the one the kept ranks started in (the start
time that bigfit's commands stamp aside: _environment), and after a failed call (its ranks are killed:
a failure can leave a collective half done)."""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.util  # noqa: F401  its exit handler joins children: registered before ours, it runs after
import os
import queue as queue_mod
import socket
import time
import traceback
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

_SEND_FAILED = 70  # a rank's exit status when it could not put its report on the queue
# After a rank dies without a report, the others' few seconds to report their own errors (a peer in a
# collective with it fails at once, with gloo's message), before those still silent are called hung.
DEATH_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(world: int) -> int:
    """torch's intra-op threads for each of `world` ranks on this machine: its share of the cores. With
    torch's default (every core for every rank) the ranks' threads fight: on 2 cores the parity
    launch takes 40% longer."""
    import torch

    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // world))


@contextmanager
def torch_threads(n: int):
    """Compute with `n` intra-op threads inside. A single-process reference for a run_ranks job uses
    the ranks' count: bf16 and fp16 kernels round differently with another count (gpt2, FSDP2 bf16:
    parameters 4e-4 apart after 4 steps against 7.5e-9 at equal counts)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _serve(rank: int, world: int, port: int, tasks, results) -> None:
    """One rank: join the group, then run each task inside it until told to stop (None) or the parent
    is gone. A task that leaves no group behind (it destroyed it) ends this rank after its result."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads_per_rank(world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    except BaseException:
        _send(results, rank, traceback.format_exc(), None, False)
        return
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue_mod.Empty:
            if mp.parent_process() is not None and not mp.parent_process().is_alive():
                return
            continue
        if task is None:
            break
        fn, args = task
        try:
            result, tb = fn(*args), None
        except BaseException:
            result, tb = None, traceback.format_exc()
        _send(results, rank, tb, result, dist.is_initialized())
        if not dist.is_initialized():
            return
    dist.destroy_process_group()


def _send(results, rank: int, tb: str | None, result, kept_group: bool) -> None:
    """Put this rank's report on `results`, its result pickled here first: Queue.put pickles in a
    feeder thread, which prints an error there to stderr and sends nothing, so a result that cannot
    be pickled (or whose tensors cannot be shared: multiprocessing's AF_UNIX socket path past 107 bytes
    under a long TMPDIR) left the caller waiting out its whole timeout (240 s). Such an error is sent
    as this rank's traceback; a rank that cannot send even that exits, which collect sees at once."""
    try:
        payload = ForkingPickler.dumps(result)  # tensors are shared (torch's reductions), not copied
    except BaseException:
        tb, payload = f"{tb or ''}its result could not be sent:\n{traceback.format_exc()}", ForkingPickler.dumps(None)
    try:
        results.put((rank, tb, bytes(payload), kept_group))
    except BaseException:
        traceback.print_exc()
        os._exit(_SEND_FAILED)


class _Ranks:
    """`world` processes in one process group, each taking tasks from its own queue."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world, self.env, self.intact = world, _environment(), True
        self.results, self.tasks = ctx.Queue(), [ctx.Queue() for _ in range(world)]
        port = _free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, self.tasks[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def submit(self, fn, args) -> None:
        for q in self.tasks:
            q.put((fn, args))

    def collect(self, deadline: float, timeout_s: float) -> tuple[dict, dict]:
        results, errors, died = {}, {}, None
        # Drain the queue before joining: a child cannot exit while its large result is still unread.
        while len(results) + len(errors) < self.world and time.monotonic() < deadline:
            try:
                rank, tb, payload, kept_group = self.results.get(timeout=0.5)
            except queue_mod.Empty:
                silent = [r for r in range(self.world) if r not in results and r not in errors]
                if died is None and any(self.procs[r].exitcode is not None for r in silent):
                    died = min(r for r in silent if self.procs[r].exitcode is not None)
                    deadline = min(deadline, time.monotonic() + DEATH_GRACE_S)
                if all(self.procs[r].exitcode is not None for r in silent):
                    break  # every silent rank is gone: nothing more can come
                continue
            self.intact &= kept_group
            try:
                result = ForkingPickler.loads(payload)
            except BaseException:
                tb = f"{tb or ''}its result could not be read here:\n{traceback.format_exc()}"
            (errors.__setitem__(rank, tb) if tb else results.__setitem__(rank, result))
        for rank in range(self.world):
            if rank not in results and rank not in errors:
                errors[rank] = self._silence(rank, died, timeout_s)
        return results, errors

    def _silence(self, rank: int, died: int | None, timeout_s: float) -> str:
        """Why `rank` sent no report."""
        code = self.procs[rank].exitcode
        if code == _SEND_FAILED:
            return "could not put its report on the queue (its traceback is on its stderr)"
        if code is not None:
            return f"died with exit code {code} before reporting"
        if died is not None:
            return f"still running {DEATH_GRACE_S:.0f}s after rank {died} died (waiting for it in a collective?)"
        return f"still running after {timeout_s}s (hung in a collective?)"

    @property
    def reusable(self) -> bool:
        return self.intact and all(p.is_alive() for p in self.procs) and self.env == _environment()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(5 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join()


def _environment() -> dict:
    """The environment kept ranks must have started in. Not pytest's current test, nor the wall clock
    that every in-process `bigfit` command stamps (launch.STARTED_ENV, read only for the time to the
    first step): with it, each command run in a test would end the kept ranks, and the next call would
    start them again. Kept ranks accumulate the gloo groups their tasks make (70-odd polling threads
    after a file, 0.36 CPU-s every 10 s an idle rank); with restarts back the suite still used more CPU
    (38.3 CPU-minutes against 32.8 on fresh clones, 2026-12-06)."""
    from bigfit.common.processes import STARTED_ENV

    return {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", STARTED_ENV)}


_kept: dict[int, _Ranks] = {}


@atexit.register
def _close_kept() -> None:
    while _kept:
        _kept.popitem()[1].close()


def release(*world_sizes: int) -> None:
    """End the kept ranks of these sizes: a file that alone uses a size (its one-rank or four-rank
    calls) ends them after its tests, instead of leaving their idle polling threads to the other
    files of its worker (each idle rank 0.36 CPU-s every 10 s: _environment)."""
    for size in world_sizes:
        if (ranks := _kept.pop(size, None)) is not None:
            ranks.close()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 240.0, fresh: bool = False, meanwhile=None) -> list:
    """fn(*args) on every rank, inside an initialised process group; returns the results in rank
    order. Raises AssertionError with each failing rank's traceback, or naming ranks that hung.
    `fresh`: on new processes, started for this call and ended after it (a measurement of a whole
    process, such as its peak RSS); otherwise on the kept ranks, the same processes and group as
    the previous call's. `meanwhile()`: run in this process while the ranks work (they leave a core
    idle part of the time, waiting for each other)."""
    ranks = None if fresh else _kept.pop(world_size, None)
    if ranks is not None and not ranks.reusable:
        ranks.close()
        ranks = None
    ranks = ranks or _Ranks(world_size)
    ranks.submit(fn, args)
    deadline = time.monotonic() + timeout_s
    try:
        if meanwhile is not None:
            meanwhile()
    finally:
        results, errors = ranks.collect(deadline, timeout_s)
    if errors:
        ranks.close(graceful=False)
        raise AssertionError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    if fresh:
        ranks.close()
    else:
        _kept[world_size] = ranks
    return [results[r] for r in range(world_size)]


def train(cfg):
    """`bigfit train`'s loop on this rank with settings `cfg`, as a rank of a torchrun job runs it: the
    job resolved here, for this process's world."""
    from bigfit.common.distributed import world_size
    from bigfit.job.resolution import resolve
    from bigfit.training.loop import train as run

    return run(resolve(cfg, world_size()))
