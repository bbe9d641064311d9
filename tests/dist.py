"""Run a function on N gloo ranks (separate processes) and report every failing rank's traceback."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from contextlib import contextmanager


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


def _entry(fn, rank: int, world: int, port: int, queue, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads_per_rank(world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        result = fn(*args)
        dist.destroy_process_group()
        queue.put((rank, None, result))
    except BaseException:
        queue.put((rank, traceback.format_exc(), None))


def run_ranks(fn, world_size: int, *args, timeout_s: float = 240.0) -> list:
    """fn(*args) on every rank, inside an initialised process group; returns the results in rank
    order. Raises AssertionError with each failing rank's traceback, or naming ranks that hung."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, deadline = {}, {}, time.monotonic() + timeout_s
    # Drain the queue before joining: a child cannot exit while its large result is still unread.
    while len(results) + len(errors) < world_size and time.monotonic() < deadline:
        try:
            rank, tb, result = queue.get(timeout=0.5)
        except queue_mod.Empty:
            if all(p.exitcode is not None for p in procs) and queue.empty():
                break  # someone died without a word
            continue
        (errors.__setitem__(rank, tb) if tb else results.__setitem__(rank, result))
    for rank, p in enumerate(procs):
        p.join(5 if rank in results or rank in errors else 0)
        if p.is_alive():
            p.kill()
            p.join()
        if rank not in results and rank not in errors:
            errors[rank] = (f"still running after {timeout_s}s (hung in a collective?)" if p.exitcode in (None, -9)
                            else f"died with exit code {p.exitcode} before reporting")
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]
