"""Launch where users are: SLURM's srun seen as torchrun (its hostlists, its tasks-per-node counts, the
torchrun names filled from its variables, two fake srun tasks joining one gloo group), and
`bigfit.launch` (a function on N new processes: return values, a failing rank stopping a stuck peer,
a function defined in a `__main__` without a file, as a notebook's is)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import bigfit
from bigfit.common import distributed
from bigfit.common.launchers import expand_hostlist, from_slurm, slurm_port, slurm_torchrun_env, tasks_on_node
from bigfit.errors import BigfitError
from bigfit.userloop import launch as launch_mod

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
# node 1 of an srun step of 2 nodes x 8 tasks, as srun sets it for its task 9
STEP = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_TASKS_PER_NODE": "8(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_STEP_NODELIST": "gpu[007-008]"}


@pytest.mark.parametrize("hostlist, hosts", [
    ("gpu[001-004,007],login1", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007", "login1"]),
    ("node17", ["node17"]),
    ("a[8-10],b[08-10]", ["a8", "a9", "a10", "b08", "b09", "b10"]),  # the start's width, as SLURM pads
    ("n1,n2", ["n1", "n2"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),  # as scontrol expands it
    ("", []),
])
def test_slurm_hostlists_expand_in_order(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_tasks_per_node_counts():
    assert [tasks_on_node("4(x2),3", n) for n in range(3)] == [4, 4, 3]
    assert tasks_on_node("8", 0) == 8
    with pytest.raises(ValueError, match="4x2"):
        tasks_on_node("4x2", 0)


def test_an_srun_task_becomes_a_torchrun_rank():
    assert slurm_torchrun_env(dict(STEP)) == {
        "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu007", "MASTER_PORT": str(20000 + 123456 % 20000)}
    assert slurm_port("123456") == 23456
    # the user's MASTER_PORT and MASTER_ADDR win; SLURM_NTASKS_PER_NODE (a plain count) where the step's is absent
    mine = dict(STEP, MASTER_PORT="29500", MASTER_ADDR="head", SLURM_NTASKS_PER_NODE="8")
    del mine["SLURM_STEP_TASKS_PER_NODE"]
    assert {k: slurm_torchrun_env(mine)[k] for k in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_WORLD_SIZE")} == {
        "MASTER_PORT": "29500", "MASTER_ADDR": "head", "LOCAL_WORLD_SIZE": "8"}


@pytest.mark.parametrize("change", [
    {"RANK": "0", "WORLD_SIZE": "2"},               # torchrun's worker (`srun torchrun ...`, accelerate): its own
    {"SLURM_STEP_ID": None},                        # the batch script itself: one process, SLURM_NTASKS the job's
    {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"},  # a one-task srun
])
def test_nothing_is_filled_outside_an_srun_step_of_several_tasks(change):
    env = {k: v for k, v in (STEP | change).items() if v is not None}
    before = dict(env)
    assert from_slurm(env) == {} and env == before


def test_the_runtime_reads_slurm_where_it_reads_torchrun(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN} | STEP
    monkeypatch.setattr(os, "environ", env)  # from_slurm writes os.environ: a copy, gone after the test
    assert distributed.launched_by_torchrun_env() and distributed.world_size() == 16
    assert (env["RANK"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("9", "1", "gpu007")
    assert from_slurm() == {}  # once filled, RANK is there: nothing again


def _free_slurm_job_id() -> int:
    """A job id whose derived port (20000 + id % 20000) is free on this machine now."""
    for port in range(20000 + os.getpid() % 10000, 40000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 100000 + port - 20000
    raise RuntimeError("no free port in 20000-39999")


def _fake_step(ntasks: int) -> dict[str, str]:
    """This process's environment without torchrun's names, with an srun step's of `ntasks` tasks on this
    node (each task adds its SLURM_PROCID and SLURM_LOCALID)."""
    return {k: v for k, v in os.environ.items() if k not in TORCHRUN} | {
        "SLURM_JOB_ID": str(_free_slurm_job_id()), "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(ntasks),
        "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_TASKS_PER_NODE": str(ntasks),
        "SLURM_JOB_NODELIST": "localhost", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_two_fake_srun_tasks_join_one_group():
    """Two processes with only SLURM's variables (as `srun -n 2` starts them on one node) reach the
    same gloo group through init_runtime, on the port derived from the job id."""
    script = textwrap.dedent("""
        from bigfit.common.distributed import all_reduce_sum, init_runtime, shutdown
        rt = init_runtime(timeout_s=30)
        print(rt.rank, rt.world_size, all_reduce_sum([rt.rank + 1.0], rt)[0])
        shutdown(rt)
    """)
    tasks = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=_fake_step(2) | {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
             for r in (0, 1)]
    outs = [t.communicate(timeout=60)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs
    assert [o.split()[-3:] for o in outs] == [["0", "2", "3.0"], ["1", "2", "3.0"]]


def test_bigfit_train_under_fake_srun_is_one_job(tmp_path, model_dirs, pairs_file):
    """`srun -n 2 python -m bigfit train ...`: each task a rank, as under torchrun; rank 0 speaks."""
    from conftest import read_jsonl

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bigfit", "train", "--model", str(model_dirs["llama"]), "--data", str(pairs_file),
           "--max-steps", "2", "--eval-every", "0", "--save-every", "0", "--batch-size", "8", "--output-dir", str(out)]
    tasks = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_fake_step(2) | {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in (0, 1)]
    outs = [t.communicate(timeout=240)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs
    assert "zero3: dp_shard 2" in outs[0] and outs[1].strip() == ""
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def all_reduce_rank(scale: float) -> tuple[int, float]:
    """One rank of bigfit.launch: the sum of every rank's rank + 1, times `scale`."""
    import torch
    import torch.distributed as dist

    rt = distributed.init_runtime(timeout_s=30)
    t = torch.tensor([rt.rank + 1.0])
    dist.all_reduce(t)
    distributed.shutdown(rt)
    return rt.rank, t.item() * scale


def test_launch_returns_every_ranks_value():
    assert bigfit.launch(all_reduce_rank, 10.0, nproc=2) == [(0, 30.0), (1, 30.0)]


def fail_on_rank_one(pid_file: str) -> None:
    """Rank 1 fails before it joins; rank 0 waits for it in the rendezvous (timeout 300 s): stuck."""
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch on rank one")
    Path(pid_file).write_text(str(os.getpid()))
    distributed.init_runtime()


def test_a_failing_rank_stops_a_stuck_peer_and_is_raised_once(tmp_path, capfd):
    pid_file = tmp_path / "rank0.pid"
    start = time.monotonic()
    with pytest.raises(BigfitError, match=r"^bigfit.launch: rank 1 failed: ValueError: bad batch on rank one$"):
        bigfit.launch(fail_on_rank_one, str(pid_file), nproc=2)
    # measured 2-4 s on 2 cores (interpreter starts, then SIGTERM at once); rank 0 alone would wait 300 s
    assert time.monotonic() - start < 30
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    err = capfd.readouterr().err
    assert err.count("Traceback") == 1 and 'raise ValueError("bad batch on rank one")' in err


def test_a_function_of_main_without_a_file_runs(tmp_path):
    """A notebook's functions and classes live in a `__main__` that another process cannot import: they
    travel by value. Here a script read from stdin, whose `__main__` has no file either."""
    script = textwrap.dedent("""
        import os
        from dataclasses import dataclass
        import bigfit

        @dataclass
        class Seen:
            rank: int
            world: int

        def main(offset):
            print("hello from", os.environ["RANK"])
            return Seen(int(os.environ["RANK"]) + offset, int(os.environ["WORLD_SIZE"]))

        print(bigfit.launch(main, 100, nproc=2))
    """)
    r = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "[Seen(rank=100, world=2), Seen(rank=101, world=2)]" in r.stdout
    assert "hello from 0\n" in r.stdout and "[rank 1] hello from 1\n" in r.stdout


@pytest.mark.parametrize("nproc", [0, -1, 1.5, "2", True])
def test_launch_refuses_a_bad_process_count(nproc):
    with pytest.raises(BigfitError, match=f"nproc must be a whole number of processes, 1 or more, got {nproc!r}"):
        bigfit.launch(all_reduce_rank, 1.0, nproc=nproc)


def test_launch_refuses_more_processes_than_gpus_and_a_launch_inside_a_rank(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(BigfitError, match="nproc=2 needs one GPU per process, but 1 are visible; use nproc=1"):
        launch_mod.launch(all_reduce_rank, 1.0, nproc=2)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(BigfitError, match="already rank 3 of 4 .*: call all_reduce_rank\\(\\) directly"):
        launch_mod.launch(all_reduce_rank, 1.0, nproc=2)
