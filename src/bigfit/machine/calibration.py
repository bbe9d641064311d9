"""This machine's measured figures, kept per device type in the cache (hardware.calibration_path) for
`bigfit plan` and `--strategy auto`: what `bigfit plan --calibrate` measures (commands/calibrate.py:
the host's cost per operator issued, its Adam step's rates), a disk's free space and bandwidth for
the NVMe tier (`disk`), and on a machine without GPUs the fp32 matmul and memory rates its cores give
the processes that compute in their place (`cpu_rates`). The measures here are cheap and need no
model; the ones that run a model step live above the planner (commands/calibrate.py)."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ..common.processes import allowed_cores  # the same cores the launcher shares among its workers
from .hardware import calibration_path, keep_unkept, unkept

def read_cache() -> dict:
    try:
        kept = json.loads(calibration_path().read_text())
    except (OSError, ValueError):
        kept = {}  # first calibration, or an unreadable file: written afresh
    return {**kept, **unkept()} if isinstance(kept, dict) else unkept()


def write_cache(kept: dict) -> str | None:
    """Keep `kept` in the cache; where the cache cannot be written (a read-only home, a full disk) the
    figures hold for this process only (hardware.unkept) and the reason is returned: a measure is
    worth having without a cache, and the cheap ones (a disk's, the cores') are simply measured again."""
    path = calibration_path()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(kept, indent=1))
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a full disk's half-written file
        keep_unkept(kept)
        return f"{path} cannot be written ({e.strerror or e})"
    return None


DISK_PROBE_BYTES = 256 * 2**20  # enough to pass a disk's write cache; ~0.1-0.3 s on an NVMe drive


def disk(path: str) -> tuple[int, float]:
    """(free bytes, GB/s) of the filesystem that would hold `path` (the NVMe tier's directory, which need
    not exist yet): its free space now, and its bandwidth, measured once per filesystem and kept in the
    cache. The measure writes a file of DISK_PROBE_BYTES beside nothing of the user's (a fresh temporary
    directory under the nearest existing ancestor that is writable), syncs it, drops it from the page
    cache and reads it back; the slower direction is the tier's rate (it reads and writes each step)."""
    where = _existing(Path(path))
    free = shutil.disk_usage(where).free
    key = f"disk-{os.stat(where).st_dev}"
    kept = read_cache()
    if key in kept and kept[key].get("gbps", 0) > 0:
        return free, float(kept[key]["gbps"])
    gbps = _measure_disk(where)
    kept[key] = {"gbps": gbps, "path": str(where), "measured": datetime.datetime.now().isoformat(timespec="seconds")}
    write_cache(kept)
    return free, gbps


def _existing(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists():
        path = path.parent
    return path


def _measure_disk(where: Path) -> float:
    block = os.urandom(4 * 2**20)
    with tempfile.TemporaryDirectory(prefix=".bigfit-disk-", dir=where) as tmp:
        name = os.path.join(tmp, "probe")
        start = time.perf_counter()
        with open(name, "wb", buffering=0) as f:
            for _ in range(DISK_PROBE_BYTES // len(block)):
                f.write(block)
            os.fsync(f.fileno())
        write = time.perf_counter() - start
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache
            start = time.perf_counter()
            while os.read(fd, len(block)):
                pass
            read = time.perf_counter() - start
        finally:
            os.close(fd)
    return DISK_PROBE_BYTES / max(write, read) / 1e9


CPU_RATES = "cpu-rates"  # the cache's key for cpu_rates' record
MATMUL_N = 1024  # fp32 square matmuls of 2.1 GFLOP: 7-9 ms each on the 2-core machine (2026-12-05)
COPY_BYTES = 256 * 2**20  # a copy past the caches' share a process can count on: 20-45 ms here
MEASURE_S = 0.05  # each rate's timed repeats, at least 3: the best one stands, as the least disturbed


def cpu_rates() -> dict:
    """This machine's fp32 matmul TFLOP/s ("tflops") and memory GB/s ("mem_gbps": a copy's reads and
    writes counted, as devicecost.py counts an operator's traffic) on all the cores this process may use,
    measured once per core count (~0.3 s) and kept in the cache; `calibrate` measures them afresh. What
    a machine without GPUs plans its processes' compute from (planning/devicecost.py cpu_device_rates)."""
    cores = allowed_cores()
    kept = read_cache()
    record = kept.get(CPU_RATES)
    if isinstance(record, dict) and record.get("cores") == cores and _positive(record, "tflops", "mem_gbps"):
        return record
    kept[CPU_RATES] = record = measure_cpu()
    write_cache(kept)
    return record


def _positive(record: dict, *keys: str) -> bool:
    return all(isinstance(record.get(k), (int, float)) and record[k] > 0 for k in keys)


def measure_cpu() -> dict:
    """Both rates with a torch thread per allowed core (the launcher gives N workers a share each),
    torch's own thread count restored after."""
    cores, threads = allowed_cores(), torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        a = torch.randn(MATMUL_N, MATMUL_N)
        tflops = 2 * MATMUL_N**3 / _best(lambda: torch.mm(a, a)) / 1e12
        src = torch.ones(COPY_BYTES // 4)
        dst = torch.empty_like(src)
        gbps = 2 * COPY_BYTES / _best(lambda: dst.copy_(src)) / 1e9
    finally:
        torch.set_num_threads(threads)
    return {"tflops": tflops, "mem_gbps": gbps, "cores": cores, "torch": torch.__version__,
            "measured": datetime.datetime.now().isoformat(timespec="seconds")}


def _best(work) -> float:
    """The shortest seconds of `work` over MEASURE_S of repeats (at least 3), after one untimed run
    (the first touches the pages and warms the kernels)."""
    work()
    times, start = [], time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < MEASURE_S:
        begun = time.perf_counter()
        work()
        times.append(time.perf_counter() - begun)
    return min(times)
