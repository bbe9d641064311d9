import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# multiprocessing makes its AF_UNIX sockets (a rank pool's shared tensors: resource_sharer; a Manager's,
# a Listener's) at TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and a socket's path holds 107 bytes. With the
# run's root and each xdist worker's nested in the user's TMPDIR, one of 32 characters or more passed it:
# no tensor a rank returned could be sent, and under a TMPDIR of 60 characters three rank-pool files
# (tensor parallel, loading, QLoRA) failed in 6 min 38 s, their pools waiting out 240 s timeouts (98 s now).
SOCKET_PATH_MAX = 107
SOCKET_TAIL = len("/pymp-XXXXXXXX/listener-XXXXXXXX")  # the longest name multiprocessing makes under TMPDIR
ROOT_PREFIX, WORKER_PREFIX = "bigfit-tests-", "w-"
ROOT_ENV = "BIGFIT_TESTS_ROOT"  # the controller's root, where xdist's workers (which inherit it) make theirs
SHORT_BASES = ("/tmp", "/var/tmp", "/dev/shm")


def nested_room(base: str) -> int:
    """The longest socket path under a root made in `base` and a worker's root inside it."""
    return len(base) + len(f"/{ROOT_PREFIX}12345678/{WORKER_PREFIX}12345678") + SOCKET_TAIL


def temp_root(tmpdir: str) -> str:
    """A new directory for a pytest run's temporary files: in `tmpdir` (the user's TMPDIR) where that
    leaves multiprocessing's sockets room, else in the first short writable base."""
    fits = [b for b in (tmpdir, *SHORT_BASES) if nested_room(b) <= SOCKET_PATH_MAX and os.access(b, os.W_OK | os.X_OK)]
    return tempfile.mkdtemp(prefix=ROOT_PREFIX, dir=(fits or [tmpdir])[0])  # none: sockets may fail, files won't


# Nothing is downloaded in tests; torchrun and inductor leave folders in TMPDIR: give them ours.
os.environ["HF_HUB_OFFLINE"] = "1"
if ROOT_ENV in os.environ:  # an xdist worker: inside the controller's root, which left room for it
    _tmp = tempfile.mkdtemp(prefix=WORKER_PREFIX, dir=os.environ[ROOT_ENV])
else:
    _tmp = os.environ[ROOT_ENV] = temp_root(tempfile.gettempdir())
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_tmp, "inductor"))
os.environ["TMPDIR"] = _tmp
os.environ["XDG_CACHE_HOME"] = os.path.join(_tmp, "cache")  # bigfit's calibration cache (hardware.calibration_path)
tempfile.tempdir = _tmp
sys.path.insert(0, str(Path(__file__).parent))

from tiny import FAMILIES, write_model_dirs, write_pairs  # noqa: E402

# The files that take longest on 2 cores, longest first (their module fixtures train every case on rank
# pools, or their tests run bigfit's commands in processes of their own: 30-170 s each against a few
# seconds for most files). They are collected first, and `make test` hands files to its two workers in
# that order (--no-loadscope-reorder): the many short files come last and even out the workers' ends,
# where a long file started last would keep one worker busy while the other has nothing left.
LONGEST = ("test_parallel_apply.py", "test_launch.py", "test_bench.py", "test_commands_autobatch.py", "test_parity.py", "test_adapters_lora.py",
           "test_resume.py", "test_userloop.py", "test_loading.py", "test_planning.py", "test_plan_accuracy.py",
           "test_tensor_adapters.py", "test_outputs_ownership.py", "test_tensor.py", "test_qlora_strategies.py",
           "test_userloop_hf.py", "test_launchers.py", "test_context_parallel.py")


def pytest_collection_modifyitems(items) -> None:
    first = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONGEST)))  # stable: each file's own order kept


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "alone: times this machine's speed; no other worker's test runs beside it")


def pytest_sessionfinish(session, exitstatus) -> None:
    """The controller removes the run's temporary root (the workers' are in it) when every test passed: a
    whole run leaves some hundred MB there; after a failure it stays, to be looked at."""
    if not hasattr(session.config, "workerinput") and exitstatus == 0:
        shutil.rmtree(_tmp, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist's controller, for each worker: where the workers meet (the controller's own TMPDIR)."""
    node.workerinput["bigfit_machine"] = os.path.join(_tmp, "machine")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test of a worker holds the machine shared, and an `alone` one holds it to itself (its setup,
    module fixtures included, to its teardown): with the other worker's test beside it, a timed step on
    2 cores read twice its prediction (CI, 2026-12-07), as the two processes' threads wait on each other."""
    base = getattr(item.config, "workerinput", {}).get("bigfit_machine")
    if base is None:  # one process: nothing runs beside it
        yield
        return
    with _machine_to_itself(Path(base), item.get_closest_marker("alone") is not None):
        yield


@contextlib.contextmanager
def _machine_to_itself(base: Path, alone: bool):
    """A readers-writer lock of flock(2)s, with writers first: each test takes the turn before its share,
    and an `alone` test keeps the turn while it waits, so no worker starts another test before it."""
    with open(f"{base}.turn", "a") as turn, open(f"{base}.use", "a") as use:
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(use, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turn, fcntl.LOCK_UN)
        yield  # closing the files lets both go


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """A directory holding only config.json for each tiny model family."""
    return write_model_dirs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def pairs_file(tmp_path_factory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl", n=400)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def bigfit(*argv, fault: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    """`python -m bigfit ARGV` in a process of its own, as a user starts it (`fault`: BIGFIT_FAULT, common/faults.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("BIGFIT_FAULT", "BIGFIT_OUTPUT_CLAIMED")}
    if fault:
        env["BIGFIT_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "bigfit", *map(str, argv)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones too) and its bytes: equal snapshots mean nothing was touched."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def one_line(err: str) -> str:
    """The one error line a user mistake must give (no traceback, nothing else on stderr)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# A finished one-process run: the tiny T5 (tests/tiny.py), 4 steps, checkpoints at steps 2 and 4
RUN_ARGS = ["--strategy", "single", "--max-steps", "4", "--save-every", "2", "--eval-every", "0", "--batch-size", "4",
            "--eval-samples", "4", "--num-beams", "1", "--max-new-tokens", "4", "--lr-schedule", "constant"]


@pytest.fixture(scope="session")
def finished_run(model_dirs, pairs_file, tmp_path_factory) -> tuple[Path, list[str]]:
    """(its output directory, the arguments that made it: add --output-dir). Copy it before changing it."""
    from bigfit.cli import main

    out = tmp_path_factory.mktemp("finished") / "out"
    args = ["train", "--model", str(model_dirs["t5"]), "--data", str(pairs_file), *RUN_ARGS]
    assert main([*args, "--output-dir", str(out)]) == 0
    return out, args


@pytest.fixture
def run_copy(finished_run, tmp_path) -> tuple[Path, list[str]]:
    """A copy of the finished run, in this test's directory, to change as the test likes."""
    out, args = finished_run
    shutil.copytree(out, tmp_path / "out")
    return tmp_path / "out", args


__all__ = ["FAMILIES", "bigfit", "one_line", "read_jsonl", "snapshot"]
