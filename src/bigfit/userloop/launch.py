"""`bigfit.launch(fn, *args, nproc=N)`: run a function on N new processes of this machine, each one rank of
a job with torchrun's environment, from a script or a notebook; returns every rank's return value.

The processes are new interpreters (`python -m bigfit.userloop.rank`), never forks: a notebook that has
touched CUDA cannot fork a process that uses it. The function travels by value (cloudpickle), so one
defined in a notebook or a script's `__main__` works without being importable, and the script is not
run again in each process (multiprocessing's spawn re-imports `__main__`, which a notebook cannot).
Each rank's output is relayed to this process's (so a notebook shows it), rank 0's as it is, the
others' behind `[rank N]`. The first rank that fails stops the others, a peer stuck in a collective
too (SIGTERM, then SIGKILL), and is raised as one BigfitError; its traceback is printed above it.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import cloudpickle

from ..commands.launch import free_port
from ..common.distributed import launched_by_torchrun_env
from ..common.processes import allowed_cores
from ..errors import BigfitError

GRACE_S = 5.0  # a stopped rank's time to exit on SIGTERM before SIGKILL
POLL_S = 0.05  # how often the ranks are looked at: a failure stops the others within this


def launch(fn, *args, nproc: int, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `nproc` new processes, rank r with RANK=r, WORLD_SIZE=nproc,
    LOCAL_RANK=r, LOCAL_WORLD_SIZE=nproc, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT (so
    `bigfit.prepare` or `torch.distributed.init_process_group()` inside `fn` joins them); returns the
    ranks' return values in rank order. `fn`, its arguments and its return values are pickled
    (cloudpickle): return numbers or CPU tensors, not a model."""
    _check(fn, nproc)
    try:
        payload = pickle.dumps({"path": list(sys.path), "call": cloudpickle.dumps((fn, args, kwargs)),
                                "file": getattr(getattr(fn, "__code__", None), "co_filename", None)})
    except Exception as e:  # a lock, an open file, a generator among what fn refers to
        raise BigfitError(f"bigfit.launch: {_name(fn)} and its arguments cannot be sent to the processes "
                          f"({type(e).__name__}: {e}); pass only picklable values") from None
    with tempfile.TemporaryDirectory(prefix="bigfit-launch-") as tmp:
        (Path(tmp) / "call.pkl").write_bytes(payload)
        procs = [_start(rank, nproc, Path(tmp), port) for port in [free_port()] for rank in range(nproc)]
        relays = [t for rank, p in enumerate(procs) for t in _relay(rank, p)]
        try:
            failed = _wait(procs)
        except BaseException:  # Ctrl-C in the notebook: no rank outlives the cell
            _stop(procs)
            raise
        finally:  # a rank's own child (a data loader's worker) may hold its pipes: not waited for long
            for t in relays:
                t.join(GRACE_S)
        if failed is not None:
            raise _failure(failed, procs, Path(tmp))
        return [_result(Path(tmp), rank) for rank in range(nproc)]


def _name(fn) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _check(fn, nproc) -> None:
    """The caller's mistakes, before any process starts."""
    if not callable(fn):
        raise BigfitError(f"bigfit.launch: the first argument must be the function each rank runs, got {fn!r}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise BigfitError(f"bigfit.launch: nproc must be a whole number of processes, 1 or more, got {nproc!r}")
    if launched_by_torchrun_env():
        raise BigfitError(f"bigfit.launch: this process is already rank {os.environ['RANK']} of "
                          f"{os.environ['WORLD_SIZE']} (torchrun, accelerate or srun started it): call "
                          f"{_name(fn)}() directly")
    import torch  # here: a mistake above is found without it

    gpus = torch.cuda.device_count()
    if gpus and nproc > gpus:
        raise BigfitError(f"bigfit.launch: nproc={nproc} needs one GPU per process, but {gpus} are visible; "
                          f"use nproc={gpus} or fewer (or CUDA_VISIBLE_DEVICES= to run on the CPU)")


def _start(rank: int, nproc: int, tmp: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONUNBUFFERED="1")
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:  # each rank its share of the cores, as torchrun does
        env["OMP_NUM_THREADS"] = str(max(1, allowed_cores() // nproc))
    # bigfit itself may be importable only through this process's sys.path (a notebook's sys.path.insert)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "bigfit.userloop.rank", str(tmp), str(rank)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def _relay(rank: int, proc: subprocess.Popen) -> list[threading.Thread]:
    """Threads copying a rank's stdout and stderr to this process's sys.stdout and sys.stderr (in a
    notebook: the cell's output, where the ranks' own file descriptors would reach only the server's
    terminal). Rank 0's as it comes, the others' line by line behind `[rank N] `."""
    def copy(stream, name):
        prefix, rest = (b"" if rank == 0 else f"[rank {rank}] ".encode()), b""
        while chunk := os.read(stream.fileno(), 65536):
            # whole lines only, so that two ranks' lines never mix; a lone "\r" ends one too (a progress bar's)
            *lines, rest = re.split(rb"(?<=\n)|(?<=\r)(?!\n)", rest + chunk)
            _write(getattr(sys, name), b"".join(prefix + line for line in lines))
        _write(getattr(sys, name), prefix + rest if rest else b"")
        stream.close()

    threads = [threading.Thread(target=copy, args=(proc.stdout, "stdout"), daemon=True),
               threading.Thread(target=copy, args=(proc.stderr, "stderr"), daemon=True)]
    for t in threads:
        t.start()
    return threads


def _write(target, data: bytes) -> None:
    if data:
        target.write(data.decode(errors="replace"))
        target.flush()


def _wait(procs: list[subprocess.Popen]) -> int | None:
    """Wait for every rank; at the first that fails, stop the others and return its rank (None: all
    succeeded). Polled, not os.wait: a notebook's kernel may have children of its own."""
    while True:
        codes = [p.poll() for p in procs]
        if failed := [r for r, c in enumerate(codes) if c not in (None, 0)]:
            _stop(procs)
            return failed[0]
        if all(c == 0 for c in codes):
            return None
        time.sleep(POLL_S)


def _stop(procs: list[subprocess.Popen]) -> None:
    """End every rank still running: SIGTERM (a rank waiting in a collective dies at once: Python's
    default action), SIGKILL for any still there after GRACE_S."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _failure(first: int, procs: list[subprocess.Popen], tmp: Path) -> BigfitError:
    """The one error for a failed launch, its traceback printed: the earliest error a rank reported
    (the others' are often only "peer went away"), else the first rank that ended without one."""
    errors = [json.loads(f.read_text()) for f in tmp.glob("rank-*.error.json")]
    if errors:
        e = min(errors, key=lambda e: e["time"])
        print(f"bigfit.launch: rank {e['rank']} failed:\n{e['traceback']}", file=sys.stderr, end="")
        return BigfitError(f"bigfit.launch: rank {e['rank']} failed: {e['message']}")
    code = procs[first].returncode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    return BigfitError(f"bigfit.launch: rank {first} {how} before it could report an error")


def _result(tmp: Path, rank: int):
    with open(tmp / f"rank-{rank}.result.pkl", "rb") as f:
        return pickle.load(f)
