import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

# Nothing is downloaded in tests; torchrun and inductor leave folders in TMPDIR: give them ours.
os.environ["HF_HUB_OFFLINE"] = "1"
_tmp = tempfile.mkdtemp(prefix="bigfit-tests-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_tmp, "inductor"))
os.environ["TMPDIR"] = _tmp
tempfile.tempdir = _tmp
sys.path.insert(0, str(Path(__file__).parent))

from tiny import FAMILIES, write_model_dirs, write_pairs  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """A directory holding only config.json for each tiny model family."""
    return write_model_dirs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def pairs_file(tmp_path_factory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl", n=400)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


__all__ = ["FAMILIES", "read_jsonl"]
