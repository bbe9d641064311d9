"""Launchers other than torchrun, seen as torchrun: SLURM's `srun` gives each task its place in the job
under its own names (SLURM_PROCID, SLURM_LOCALID, ...); `from_slurm` writes torchrun's names
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) from them, so
everything that reads the torchrun environment (common/distributed.py, `bigfit train`) sees the job.

`accelerate launch` needs nothing here: for several processes it runs torchrun's own launcher
(torch.distributed.run), which sets torchrun's names itself.
"""
from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

PORT_BASE, PORT_SPAN = 20000, 20000  # MASTER_PORT from the job id: every task of a job computes the same one
# a bracketed group of a hostlist, "[001-004,007]", or a run of characters outside brackets and commas
_HOSTLIST_TOKEN = re.compile(r"\[[^\]]*\]|[^,\[]+")


def expand_hostlist(hostlist: str) -> list[str]:
    """The hosts of a SLURM hostlist, in order: "gpu[001-003,007],login1" -> gpu001, gpu002, gpu003,
    gpu007, login1. Numbers keep the padding of the range's start; a host may have several bracketed
    parts ("rack[1-2]-n[01-02]": rack1-n01, rack1-n02, rack2-n01, rack2-n02), as scontrol expands them."""
    hosts: list[str] = []
    for group in _split_groups(hostlist):
        parts = [[""]]
        for token in _HOSTLIST_TOKEN.findall(group):
            parts.append(_expand_brackets(token[1:-1]) if token.startswith("[") else [token])
        names = [""]
        for choices in parts:
            names = [name + choice for name in names for choice in choices]
        hosts.extend(n for n in names if n)
    return hosts


def _split_groups(hostlist: str) -> list[str]:
    """Split at the commas outside brackets: "a[1,3],b" -> "a[1,3]", "b"."""
    groups, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            groups.append(hostlist[start:i])
            start = i + 1
    groups.append(hostlist[start:])
    return [g.strip() for g in groups if g.strip()]


def _expand_brackets(inside: str) -> list[str]:
    """ "001-003,7" -> 001, 002, 003, 7: each range's numbers as wide as its start is written."""
    out = []
    for item in inside.split(","):
        lo, _, hi = item.strip().partition("-")
        if not hi:
            out.append(lo)
            continue
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Tasks on node `node` from SLURM's compressed count: "4(x2),3" is 4, 4, 3 for nodes 0, 1, 2."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ValueError(f"not a SLURM tasks-per-node count: {tasks_per_node!r}")
        counts.extend([int(m[1])] * int(m[2] or 1))
    return counts[min(node, len(counts) - 1)]


def slurm_port(job_id: str) -> int:
    """The rendezvous port of a SLURM job without MASTER_PORT: the same on every task of the job, and
    another for the next job, which may share the first node."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def slurm_torchrun_env(env: MutableMapping[str, str]) -> dict[str, str]:
    """torchrun's names for a task of an srun step of several tasks, from SLURM's; {} where there is
    nothing to fill: torchrun's RANK or WORLD_SIZE already there (torchrun inside the allocation,
    `srun torchrun ...`, accelerate), no srun step (the batch script itself holds SLURM_NTASKS of the
    whole allocation but is one process: SLURM_STEP_ID is set for srun's tasks only), or one task.
    The step's own counts (SLURM_STEP_*) win over the allocation's."""
    if "RANK" in env or "WORLD_SIZE" in env or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return {}
    world = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    if int(world) < 2:
        return {}
    node = int(env.get("SLURM_NODEID", "0"))
    per_node = (env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
                or env.get("SLURM_TASKS_PER_NODE") or world)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = expand_hostlist(nodelist)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
    return {
        "RANK": env["SLURM_PROCID"], "WORLD_SIZE": world, "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(tasks_on_node(per_node, node)), "GROUP_RANK": str(node),
        "MASTER_ADDR": env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        "MASTER_PORT": env.get("MASTER_PORT") or str(slurm_port(job_id)),
    }


def from_slurm(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Fill torchrun's names in `env` (this process's environment) from SLURM's where an srun step
    started this process (slurm_torchrun_env); returns what it set. Called wherever the torchrun
    environment is first read; a second call finds RANK set and does nothing."""
    env = os.environ if env is None else env
    filled = slurm_torchrun_env(env)
    env.update(filled)
    return filled
