"""Run a function on N gloo ranks (separate processes) and report every failing rank's traceback."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, queue, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import datetime

        import torch.distributed as dist

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
