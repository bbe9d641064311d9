"""The node's tokenized cache (data/cache.py, `--data-cache`): its memory-mapped samples are those
tokenize.py makes in memory, element for element, for pairs (encoder-decoder and decoder-only), running
text and conversations, packed or not; two ranks starting together build one entry and both map it;
a run over the cache trains as a run in memory."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from conftest import read_jsonl
from dist import run_ranks
from test_data_chat import TALK, TEMPLATE

pytest.importorskip("datasets")  # the cache's library, the `bigfit[data]` extra (the test command installs it)

CASES = [("t5", "pairs", False), ("llama", "pairs", True), ("gpt2", "text", False), ("llama", "text", True),
         ("llama", "messages", True)]


@pytest.fixture(scope="module")
def data(pairs_file, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cache-data")
    (root / "text.jsonl").write_text("".join(json.dumps({"text": f"document {i} " + "word " * (i % 37)}) + "\n"
                                             for i in range(300)))
    talks = [[*TALK[:4], {"role": "assistant", "content": str(i)}] for i in range(200)]
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": t}) + "\n" for t in talks))
    (root / "template.jinja").write_text(TEMPLATE)
    return {"pairs": pairs_file, "text": root / "text.jsonl", "messages": root / "chat.jsonl",
            "template": root / "template.jinja"}


def _config(model_dirs, data, family: str, kind: str, pack: bool, cache: str):
    from bigfit.settings.config import TrainConfig

    return TrainConfig(model=str(model_dirs[family]), data=str(data[kind]), max_source_len=32, batch_size=8, pack=pack,
                       data_cache=cache, chat_template=str(data["template"]) if kind == "messages" else None)


@pytest.mark.parametrize("family,kind,pack", CASES)
def test_the_cache_holds_the_samples_made_in_memory(model_dirs, data, tmp_path, family, kind, pack):
    from bigfit.data.arrays import ArrowSamples
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import prepare

    plain = prepare(resolve(_config(model_dirs, data, family, kind, pack, "off"), 1)).dataset
    mapped = prepare(resolve(_config(model_dirs, data, family, kind, pack, str(tmp_path)), 1)).dataset
    assert isinstance(mapped.train, ArrowSamples) and not isinstance(plain.train, ArrowSamples)
    keys = ("input_ids", "labels", "parts") if pack else ("input_ids", "labels")
    assert len(mapped.train) == len(plain.train) > 8
    assert [{k: s[k] for k in keys} for s in plain.train] == list(mapped.train)
    assert mapped.eval == plain.eval and mapped.eval  # with the pairs' strings, for BLEU
    assert (mapped.packed, mapped.pad_id) == (plain.packed, plain.pad_id)
    again = prepare(resolve(_config(model_dirs, data, family, kind, pack, str(tmp_path)), 1)).dataset
    assert again.cached == mapped.cached and len(list(tmp_path.glob("*/meta.json"))) == 1  # mapped, not rebuilt


def _prepare_on_rank(cfg):
    import os

    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import prepare

    job = prepare(resolve(cfg, 2))
    meta = json.loads((Path(job.dataset.cached) / "meta.json").read_text())
    return os.getpid(), meta["built_by"], job.dataset.train[3], len(job.dataset.train)


def test_two_ranks_starting_together_build_one_entry_and_both_map_it(model_dirs, data, tmp_path):
    cfg = _config(model_dirs, data, "llama", "text", True, str(tmp_path))
    (pid0, built0, row0, n0), (pid1, built1, row1, n1) = run_ranks(_prepare_on_rank, 2, cfg)
    assert built0 == built1 and built0 in (pid0, pid1)  # one of them built it, the other waited on the lock
    assert (row0, n0) == (row1, n1)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1  # no half-built entry left beside it


def test_a_run_over_the_cache_trains_as_in_memory(finished_run, tmp_path):
    from bigfit.cli import main

    out, args = finished_run
    assert main([*args, "--data-cache", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out")]) == 0
    assert [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == \
        [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert len(list((tmp_path / "cache").glob("*/train.arrow"))) == 1


def test_auto_takes_the_cache_from_its_size_and_on_needs_datasets(model_dirs, data, monkeypatch):
    import importlib.util

    from bigfit.data import cache
    from bigfit.errors import BigfitError

    cfg = _config(model_dirs, data, "t5", "pairs", False, "auto")
    assert not cache.wanted(cfg)  # 400 pairs: in memory
    monkeypatch.setattr(cache, "AUTO_BYTES", 1)
    assert cache.wanted(cfg) and not cache.wanted(dataclasses.replace(cfg, data_cache="off"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    assert not cache.wanted(cfg)  # auto without the library: in memory
    with pytest.raises(BigfitError, match=r"--data-cache on needs the datasets library: pip install 'bigfit\[data\]'"):
        cache.wanted(dataclasses.replace(cfg, data_cache="on"))



def test_a_mistake_in_the_data_is_its_one_line_and_leaves_no_entry(model_dirs, tmp_path):
    from bigfit.settings.config import TrainConfig
    from bigfit.errors import BigfitError
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import prepare

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "one", "target": "1"}\n' * 2 + '{"source": "two", "target": \n')
    cfg = TrainConfig(model=str(model_dirs["t5"]), data=str(bad), batch_size=1, data_cache=str(tmp_path / "cache"))
    with pytest.raises(BigfitError, match=r"bad.jsonl' line 3 is not valid JSON"):
        prepare(resolve(cfg, 1))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [next((tmp_path / "cache").glob("*.lock")).name]
