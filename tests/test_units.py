"""Pure pieces: batch order, config resolution, schedules, data files, block discovery."""
from __future__ import annotations

import json

import pytest

from bigfit.config import TrainConfig, load_config_file, resolve
from bigfit.data import Batcher, read_examples
from bigfit.errors import BigfitError
from bigfit.train.step import lr_at


@pytest.mark.parametrize("world,micro", [(1, 8), (1, 2), (2, 4), (2, 1), (4, 2)])
def test_layouts_cover_exactly_the_global_batch(world, micro):
    b = Batcher(n_samples=50, batch_size=8, seed=3)
    for step in range(10):  # crosses epoch boundaries
        parts = [i for r in range(world) for mb in b.micro_batches(step, r, world, micro) for i in mb]
        assert parts == b.global_batch(step)
        assert all(len(mb) == micro for r in range(world) for mb in b.micro_batches(step, r, world, micro))


def test_batch_order_is_a_function_of_seed_and_step():
    a, b = Batcher(50, 8, seed=3), Batcher(50, 8, seed=3)
    later = [b.global_batch(s) for s in range(12)]
    assert [a.global_batch(s) for s in range(12)] == later
    epoch = [i for s in range(7) for i in a.global_batch(s)][:50]
    assert sorted(epoch) == list(range(50))  # every sample once per epoch
    assert Batcher(50, 8, seed=4).global_batch(0) != later[0]


def test_resolve_splits_global_batch():
    cfg = resolve(TrainConfig(batch_size=32, micro_batch_size=4), world_size=2)
    assert (cfg.extra["per_rank_batch"], cfg.extra["grad_accum"], cfg.micro_batch_size) == (16, 4, 4)
    assert resolve(TrainConfig(batch_size=32), world_size=4).micro_batch_size == 8


@pytest.mark.parametrize("kw,world,needle", [
    (dict(batch_size=30), 4, "--batch-size 30 is not divisible by the 4 processes"),
    (dict(batch_size=32, micro_batch_size=5), 2, "valid: 1, 2, 4, 8, 16"),
    (dict(strategy="zero9"), 1, "'zero9' is not valid; choose one of: single, ddp, zero3"),
    (dict(max_steps=-3), 1, "--max-steps must be a positive integer, got -3"),
    (dict(nproc=0), 1, "--nproc must be at least 1, got 0"),
    (dict(precision="fp8"), 1, "'fp8'"),
])
def test_resolve_errors_name_the_value(kw, world, needle):
    with pytest.raises(BigfitError, match=needle.replace("(", r"\(")):
        resolve(TrainConfig(**kw), world)


def test_lr_schedule_warms_up_then_decays_to_zero():
    lrs = [lr_at(s, 1.0, warmup=4, total=12) for s in range(12)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[-1] == pytest.approx(1 / 8) and all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_config_file_unknown_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_steps: 5\nlearning_rate: 0.1\n")
    with pytest.raises(BigfitError, match="unknown setting.*'learning_rate'.*valid: model, data"):
        load_config_file(str(f))
    f.write_text("max-steps: 5\nbatch_size: 4\n")
    assert load_config_file(str(f)) == {"max_steps": 5, "batch_size": 4}


def test_data_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"source": "a", "target": "b"}\n\n{"text": "x"}\n')
    with pytest.raises(BigfitError, match="mixes"):
        read_examples(str(tmp_path / "a.jsonl"))
    (tmp_path / "b.jsonl").write_text('{"source": "a", "target": "b"}\n{"source": "a", "target": \n')
    with pytest.raises(BigfitError, match="line 2 is not valid JSON"):
        read_examples(str(tmp_path / "b.jsonl"))
    (tmp_path / "c.jsonl").write_text('{"source": "a", "target": "b"}\n{"source": "a"}\n')
    with pytest.raises(BigfitError, match="line 2: each record needs 'source' and 'target'"):
        read_examples(str(tmp_path / "c.jsonl"))
    (tmp_path / "d.csv").write_text("source,target\nhello,world\nbye,\n")
    assert read_examples(str(tmp_path / "d.csv")) == [{"source": "hello", "target": "world"},
                                                      {"source": "bye", "target": ""}]
    (tmp_path / "e.csv").write_text("src,tgt\nhello,world\n")
    with pytest.raises(BigfitError, match="header row"):
        read_examples(str(tmp_path / "e.csv"))
    (tmp_path / "f.txt").write_text("some text\n")
    assert read_examples(str(tmp_path / "f.txt")) == [{"text": "some text\n"}]
    with pytest.raises(BigfitError, match="does not exist"):
        read_examples(str(tmp_path / "missing.jsonl"))


def test_block_lists_find_every_stack(model_dirs):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from bigfit.models import block_lists

    found = {}
    for family, d in model_dirs.items():
        config = AutoConfig.from_pretrained(d)
        auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
        found[family] = [(name, len(blocks)) for name, blocks in block_lists(auto.from_config(config))]
    assert found == {"t5": [("encoder.block", 2), ("decoder.block", 3)], "gpt2": [("transformer.h", 2)],
                     "llama": [("model.layers", 2)]}


def test_jsonl_config_roundtrip(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"strategy": "ddp", "nproc": 2}))
    assert load_config_file(str(f)) == {"strategy": "ddp", "nproc": 2}
