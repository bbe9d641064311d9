"""Starting local workers: `bigfit train --nproc N` runs N copies of itself with the torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a worker
cannot tell bigfit's launcher from torchrun's, and no script ever needs a --local_rank argument.

Fail fast: the first worker that exits non-zero brings the others down (SIGTERM, then SIGKILL),
and its error is printed once. Workers report errors through a JSON file each (the path is in
BIGFIT_ERROR_FILE), the same way torchelastic's error files work.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..common.processes import JOB_ENV, LAUNCHED_ENV, allowed_cores, interrupt_name, stop_on_sigterm

GRACE_S = 5.0
STOPPED = 124  # launch_local's status where its `watch` stopped the workers (timeout(1)'s)
POLL_S = 0.5  # how often a watched launch looks at its workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: dict[int, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs.values():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _report(exits: dict[int, int], err_dir: Path, log_dir: Path) -> str:
    """The one message for a failed job. `exits`: the exit codes of the workers that had ended
    before the others were stopped. A user mistake wins; then a worker killed by a signal (the OOM
    killer, a fault: the others' errors are only "peer went away"); then the earliest error."""
    errors = [json.loads(f.read_text()) for f in err_dir.glob("rank-*.json")]
    where = f"(logs of the other ranks: {log_dir})"
    if user := [e for e in errors if e["user_error"]]:
        return f"error: {user[0]['message']}"
    if killed := sorted(r for r, c in exits.items() if c < 0):
        return f"worker rank {killed[0]} was killed by {signal.Signals(-exits[killed[0]]).name} {where}"
    if errors:
        first = min(errors, key=lambda e: e["time"])
        return f"worker rank {first['rank']} failed: {first['message']}\n{first['traceback']}{where}"
    rank, code = min(exits.items())
    return f"worker rank {rank} exited with status {code} {where}"


def _threads(nproc: int) -> dict:
    """Each worker's intra-op threads: its share of the cores, unless the user set OMP_NUM_THREADS. By
    default every torch process takes a thread per core, so N workers oversubscribe the cores N times,
    and OpenMP's spinning threads then starve gloo's: on 2 cores, 2 DDP workers of the embedded T5 took
    3.9-4.2 s a step against 0.6-0.65 s at one thread each (torchrun sets 1 for several workers)."""
    if "OMP_NUM_THREADS" in os.environ or nproc < 2:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, allowed_cores() // nproc))}


def launch_local(argv: list[str], nproc: int, log_dir: Path, quiet: bool = False, lock_fd: int | None = None,
                 job: Path | None = None, watch: Callable[[], str | None] | None = None) -> int:
    """Run `python -m bigfit <argv>` as `nproc` workers on this machine; returns the exit status
    (the first failed worker's; 128 + the signal's number for one killed by a signal).
    `quiet`: rank 0 writes a log too, and a failure is left to the caller to report (its message in
    log_dir/error.txt), an interrupt too (raised again once the workers are stopped). `lock_fd`: the
    output directory's lock (outputs/lock.py), inherited by every worker so that it stays held while
    any of them lives, even if this launcher is killed. `job`: the resolved job's file (job/resolution.py):
    the workers run it (JOB_ENV) instead of parsing `argv`, so they run exactly what was printed,
    and resolve nothing again. `watch`:
    asked every POLL_S while the workers run; once it says why (a deadline they passed), they are
    stopped, that is their report and the status STOPPED."""
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "error.txt").unlink(missing_ok=True)  # an earlier launch's
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bigfit-errors-") as tmp:
        err_dir, procs = Path(tmp), {}
        extra = _threads(nproc)
        if job is not None:
            extra[JOB_ENV] = str(Path(job).resolve())
        for rank in range(nproc):
            env = dict(os.environ, **extra, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       BIGFIT_ERROR_FILE=str(err_dir / f"rank-{rank}.json"), PYTHONUNBUFFERED="1",
                       **{LAUNCHED_ENV: repr(time.time())})
            # rank 0 talks to the terminal; the others write logs, read only when something fails
            out = None if rank == 0 and not quiet else open(log_dir / f"rank-{rank}.log", "w")
            procs[rank] = subprocess.Popen([sys.executable, "-m", "bigfit", *argv], env=env,
                                           stdout=out, stderr=subprocess.STDOUT if out else None,
                                           pass_fds=() if lock_fd is None else (lock_fd,))
        try:
            with stop_on_sigterm():
                return _wait_all(procs, err_dir, log_dir, quiet, watch)
        except KeyboardInterrupt as e:
            _stop(procs)
            if quiet:  # the caller's interrupt too (a probe's worker set): its command says it, once (cli.main)
                raise
            print(f"interrupted ({interrupt_name(e)}): all workers stopped", file=sys.stderr)
            return 130


def _wait_all(procs: dict[int, subprocess.Popen], err_dir: Path, log_dir: Path, quiet: bool,
              watch: Callable[[], str | None] | None = None) -> int:
    """Wait for every worker; at the first that fails, stop the rest and report it (0: all succeeded)."""
    by_pid = {p.pid: r for r, p in procs.items()}
    while by_pid:
        got = _next_exit(watch)
        if isinstance(got, str):
            _stop(procs)
            if quiet:
                (log_dir / "error.txt").write_text(got + "\n")
            else:
                print(got, file=sys.stderr)
            return STOPPED
        pid, status = got
        rank = by_pid.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        procs[rank].returncode = code
        if code != 0:
            # who else had already ended, before this launcher stops the rest
            exits = {r: p.poll() for r, p in procs.items() if r != rank}
            exits = {r: c for r, c in exits.items() if c is not None and c != 0} | {rank: code}
            _stop(procs)
            report = _report(exits, err_dir, log_dir)
            if quiet:  # the caller reports it; the error files go with this directory
                (log_dir / "error.txt").write_text(report + "\n")
            else:
                print(report, file=sys.stderr)
            return code if code > 0 else 128 - code  # killed by a signal: the shell's 128 + its number
    return 0


def _next_exit(watch: Callable[[], str | None] | None) -> tuple[int, int] | str:
    """The next ended child's (pid, wait status); with `watch`, looked for every POLL_S, and its message
    instead once it has one."""
    if watch is None:
        return os.wait()
    while True:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            return pid, status
        if (said := watch()) is not None:
            return said
        time.sleep(POLL_S)
