"""What a `bigfit train --nproc 2` costs before its first step, on this machine's CPU: wall time from
launch to step 1's record, the whole run's wall time, and the peak RSS (VmHWM) and CPU seconds of the
launcher and of each rank, on a JSONL of source/target pairs (default 30 MB: below the 64 MB at which
`--data-cache auto` used to start tokenizing through the node's cache). The job: the embedded tiny T5,
2 steps of a global batch of 4, no evaluation, no checkpoints, `--strategy ddp --precision fp32` (fixed,
so that trees with other defaults run the same job).

Each run is `python -m bigfit train` with PYTHONPATH=SRC, so that tree's bigfit is the one imported (each
process says which file it imported; a run whose processes imported another is refused), in a fresh
output directory and a fresh XDG_CACHE_HOME (a cold start: no data cache, no calibration kept). Every
50 ms the process tree is read from /proc: VmHWM and utime+stime of each python process (the last value
per pid), its role from the RANK in its environment; step 1 is when metrics.jsonl's first line appears.
A sitecustomize.py put first on PYTHONPATH counts, per process, argv parses (argparse's outermost
parse_known_args) and calls of the bigfit functions named by --count (module-level `name` or
`Class.method`; counted wherever a bigfit module defines one): a name a tree lacks counts nothing.

With two --src the runs alternate (A, B, A, B, ...), so that the machine's load falls on both alike;
the load average (1 min) is recorded before and after each run: on a shared machine read the medians
beside it.

  python benchmarks/startup_cost.py --src /tmp/before/src --out before.json
  python benchmarks/startup_cost.py --src /tmp/before/src --src src --label before --label after --repeat 5 --out both.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLL_S = 0.05
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
COUNT = "validate,resolve,plan_for,plan_of,ParallelPlan.__post_init__,read_examples,build_dataset,tokenized"
HOOK = r'''
import functools, json, os, sys, threading
import importlib.abc, importlib.machinery, inspect
_out, _names = os.environ["STARTUP_COST_CALLS"], set(os.environ.get("STARTUP_COST_NAMES", "").split(","))
_depth = threading.local()

def _note(call):
    with open(_out, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "rank": os.environ.get("RANK"), "call": call}) + "\n")

def _counted(fn, call, outermost=False):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        d = getattr(_depth, call, 0)
        if d == 0 or not outermost:
            _note(call)
        setattr(_depth, call, d + 1)
        try:
            return fn(*a, **k)
        finally:
            setattr(_depth, call, d)
    return wrapper

import argparse
argparse.ArgumentParser.parse_known_args = _counted(argparse.ArgumentParser.parse_known_args, "argv parse", True)

def _wrap(name, module):
    if name == "bigfit":
        _note("imported " + module.__file__)
    for key in _names:
        owner, _, attr = key.rpartition(".")
        holder = getattr(module, owner, None) if owner else module
        fn = getattr(holder, attr, None) if holder is not None else None
        mod = getattr(holder, "__module__", None) if owner else name
        if inspect.isfunction(fn) and fn.__module__ == name and mod == name:
            setattr(holder, attr, _counted(fn, name + "." + key))

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bigfit" and not name.startswith("bigfit."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            _wrap(name, module)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Finder())
'''


def write_pairs(path: Path, mb: float, seed: int = 7) -> Path:
    """Digits pairs as bigfit's embedded task makes them ("three one four" -> "3 1 4"), `mb` MB of them."""
    rng, lines, size = random.Random(seed), [], 0
    while size < mb * 1e6:
        digits = [rng.randrange(10) for _ in range(rng.randint(2, 5))]
        line = json.dumps({"source": " ".join(WORDS[d] for d in digits), "target": " ".join(map(str, digits))}) + "\n"
        lines.append(line)
        size += len(line)
    path.write_text("".join(lines))
    return path


def tree(pid: int) -> list[tuple[int, int | None]]:
    """(pid, its parent) of `pid` and its descendants, parents first."""
    out, todo = [], [(pid, None)]
    while todo:
        p, parent = todo.pop()
        out.append((p, parent))
        try:
            todo += [(int(c), p) for t in os.listdir(f"/proc/{p}/task")
                     for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            pass
    return out


def sample(pid: int, parent_role: str | None) -> tuple[str, int, float] | None:
    """(launcher, rank N, or a helper of either: a process they started that is not a rank; VmHWM in
    KiB; CPU seconds so far), None for a process that is not python (yet: a fork before its exec)."""
    try:
        cmd = open(f"/proc/{pid}/cmdline").read()
        status = open(f"/proc/{pid}/status").read()
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        ticks = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[11:13]
    except OSError:
        return None
    if "python" not in cmd:
        return None
    rank = f"rank {env['RANK']}" if "RANK" in env else None
    if parent_role is None:
        role = "launcher"
    elif rank and not parent_role.startswith(rank):
        role = rank
    else:
        role = parent_role.removesuffix(" helper") + " helper"
    hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")), 0)
    return role, hwm, sum(map(int, ticks)) / os.sysconf("SC_CLK_TCK")


def run_once(src: str | None, data: Path, root: Path, a) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    (root / "hook").mkdir(parents=True)
    (root / "hook" / "sitecustomize.py").write_text(HOOK)
    calls, out = root / "calls.jsonl", root / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(root / "cache"), "TMPDIR": str(root),
           "PYTHONPATH": os.pathsep.join(p for p in (str(root / "hook") if a.count else None, src) if p)}
    env.update(STARTUP_COST_CALLS=str(calls), STARTUP_COST_NAMES=a.count or "")
    env.pop("BIGFIT_FAULT", None)
    argv = [sys.executable, "-m", "bigfit", "train", "--nproc", "2", "--data", str(data), "--max-steps", "2",
            "--batch-size", "4", "--eval-samples", "0", "--no-checkpoints", "--output-dir", str(out), *a.args]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with open(root / "stdout.txt", "w") as so, open(root / "stderr.txt", "w") as se:
        proc = subprocess.Popen(argv, stdout=so, stderr=se, env=env, cwd=root)
    seen: dict[int, tuple[str, int, float]] = {}
    first = None
    metrics = out / "metrics.jsonl"
    try:
        while proc.poll() is None:
            for p, parent in tree(proc.pid):
                parent_role = None if parent is None else seen[parent][0] if parent in seen else "?"
                if (s := sample(p, parent_role)) is not None:
                    seen[p] = s
            if first is None and metrics.exists() and "\n" in metrics.read_text():
                first = time.perf_counter() - t0
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:  # this script was interrupted: its launcher brings its workers down
            proc.terminate()
            proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"bigfit train failed ({proc.returncode}) from {src}: {(root / 'stderr.txt').read_text()[-3000:]}")
    record = json.loads(metrics.read_text().splitlines()[0])
    return {"src": src, "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
            "first_step_s": round(first, 2) if first else None, "wall_s": round(wall, 2),
            "startup_s": record.get("startup_s"), "rank0_host_rss_gb": record.get("host_rss_gb"),
            "processes": roles(seen), "calls": counted(calls, seen, src) if a.count else None}


def roles(seen: dict[int, tuple[str, int, float]]) -> dict[str, dict]:
    """Each role's peak RSS (MiB) and CPU seconds; helpers' CPU summed over their processes, peak the largest."""
    out: dict[str, dict] = {}
    for role, kb, cpu in seen.values():
        r = out.setdefault(role, {"n": 0, "peak_rss_mib": 0.0, "cpu_s": 0.0})
        r["n"] += 1
        r["peak_rss_mib"] = max(r["peak_rss_mib"], round(kb / 1024, 1))
        r["cpu_s"] = round(r["cpu_s"] + cpu, 2)
    return dict(sorted(out.items()))


def counted(calls: Path, seen: dict, src: str | None) -> dict[str, dict[str, int]]:
    """Per role, how many times each counted thing happened; refuses a run that imported another bigfit."""
    out: dict[str, dict[str, int]] = {}
    lines = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    for c in lines:
        role = seen[c["pid"]][0] if c["pid"] in seen else f"pid {c['pid']} (rank {c['rank']})"
        if c["call"].startswith("imported "):
            where = c["call"].split(" ", 1)[1]
            if src and not Path(where).resolve().is_relative_to(Path(src).resolve()):
                raise SystemExit(f"{role} imported {where}, not bigfit from {src}")
            continue
        out.setdefault(role, {}).setdefault(c["call"], 0)
        out[role][c["call"]] += 1
    return dict(sorted(out.items()))


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)} if values else {}


def summary(runs: list[dict]) -> dict:
    """Per tree: the median and range of each figure over its runs."""
    out = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        roles_ = sorted({k for r in mine for k in r["processes"]})
        out[label] = {"runs": len(mine), "first_step_s": spread([r["first_step_s"] for r in mine]),
                      "wall_s": spread([r["wall_s"] for r in mine]),
                      "load_1min": spread([x for r in mine for x in (r["load_before"][0], r["load_after"][0])]),
                      **{f"{k} peak_rss_mib": spread([r["processes"].get(k, {}).get("peak_rss_mib") for r in mine])
                         for k in roles_},
                      **{f"{k} cpu_s": spread([r["processes"].get(k, {}).get("cpu_s") for r in mine]) for k in roles_},
                      "calls": mine[-1]["calls"]}
    return out


def print_table(runs: list[dict], summ: dict) -> None:
    print(f"{'tree':<10} {'load':>5} {'step 1 s':>9} {'wall s':>7}  peak RSS MiB / CPU s per process")
    for r in runs:
        procs = ", ".join(f"{k} {v['peak_rss_mib']:.0f}/{v['cpu_s']:.1f}" for k, v in r["processes"].items())
        print(f"{r['label']:<10} {r['load_before'][0]:>5.2f} {r['first_step_s'] or float('nan'):>9.1f} {r['wall_s']:>7.1f}  {procs}")
    for label, s in summ.items():
        print(f"\n{label}: median of {s['runs']} (min-max); load 1 min {s['load_1min'].get('min')}-{s['load_1min'].get('max')}")
        for key, v in s.items():
            if isinstance(v, dict) and "median" in v and key != "load_1min":
                print(f"  {key:<28} {v['median']:>9.1f}  ({v['min']}-{v['max']})")
        for role, calls in (s["calls"] or {}).items():
            print(f"  {role:<16} calls: " + ", ".join(f"{k.removeprefix('bigfit.')} {n}" for k, n in calls.items()))


def machine() -> dict:
    mem = next((int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    return {"host": platform.node(), "cpus": os.cpu_count(), "mem_gib": round(mem / 2**20, 1),
            "python": platform.python_version(), "platform": platform.platform()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", action="append", help="a tree's src/ (bigfit imported from it); twice: alternate "
                    "the two; default: the installed bigfit")
    ap.add_argument("--label", action="append", help="a name per --src, in order; default: the path")
    ap.add_argument("--repeat", type=int, default=3, help="runs per tree")
    ap.add_argument("--mb", type=float, default=30.0, help="size of the JSONL in MB")
    ap.add_argument("--count", default=COUNT, help="comma-separated bigfit function names to count calls of "
                    "(NAME or Class.method); '' counts nothing, puts no sitecustomize on the path and so "
                    "skips the check of which bigfit each process imported")
    ap.add_argument("--root", help="working directory (default: a temporary one, removed at the end)")
    ap.add_argument("--out", help="write the results (JSON) here")
    ap.add_argument("args", nargs="*", default=["--strategy", "ddp", "--precision", "fp32"],
                    help="after --: more `bigfit train` arguments (default: --strategy ddp --precision fp32)")
    a = ap.parse_args()
    srcs = [str(Path(s).resolve()) for s in a.src] if a.src else [None]
    labels = a.label or [s or "installed" for s in srcs]
    if len(labels) != len(srcs):
        raise SystemExit("give one --label per --src")
    root = Path(a.root or tempfile.mkdtemp(prefix="startup-cost-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    data = write_pairs(root / "pairs.jsonl", a.mb)
    size, lines = data.stat().st_size, sum(1 for _ in data.open())
    runs = []
    try:
        for i in range(a.repeat):
            for src, label in zip(srcs, labels):
                row = {"label": label, "round": i, **run_once(src, data, root / "run", a)}
                runs.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if not a.root:
            shutil.rmtree(root, ignore_errors=True)
    summ = summary(runs)
    print_table(runs, summ)
    if a.out:
        Path(a.out).write_text(json.dumps({"what": "bigfit train --nproc 2: launch to step 1, peak RSS per process",
                                           "machine": machine(), "data": {"bytes": size, "pairs": lines},
                                           "args": a.args, "count": a.count, "summary": summ, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
