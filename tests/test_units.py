"""Pure pieces: batch order, config resolution, schedules, data files, block discovery."""
from __future__ import annotations

import json
import math

import pytest
import torch

from bigfit.data import Batcher, collate, read_examples
from bigfit.errors import BigfitError
from bigfit.job.checks import validate
from bigfit.job.resolution import resolve
from bigfit.settings.config import TrainConfig
from bigfit.settings.reading import load_config_file
from bigfit.training.step import lr_at


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


def test_collate_pads_right_to_the_longest_rounded_up():
    samples = [{"input_ids": [5, 6, 7], "labels": [8]}, {"input_ids": [9], "labels": [10, 11, 12, 13]},
               {"input_ids": [], "labels": []}]
    b = collate(samples, pad_id=1, multiple=4)
    assert b["input_ids"].tolist() == [[5, 6, 7, 1], [9, 1, 1, 1], [1, 1, 1, 1]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert b["labels"].tolist() == [[8, -100, -100, -100], [10, 11, 12, 13], [-100] * 4]
    assert all(t.dtype == torch.long for t in b.values())
    b["input_ids"][0, 0] = 2  # its own memory: writable, nothing of the samples changes
    assert samples[0]["input_ids"][0] == 5
    assert collate([{"input_ids": [], "labels": []}], pad_id=0)["labels"].shape == (1, 0)


def test_resolve_splits_global_batch():
    job = resolve(TrainConfig(batch_size=32, micro_batch_size=4), world_size=2)
    assert (job.batching.per_rank, job.batching.grad_accum, job.cfg.micro_batch_size) == (16, 4, 4)
    assert resolve(TrainConfig(batch_size=32), world_size=4).cfg.micro_batch_size == 8


@pytest.mark.parametrize("kw,world,needle", [
    (dict(batch_size=30), 4, "--batch-size 30 is not divisible by the 4 data-parallel processes"),
    (dict(batch_size=32, micro_batch_size=5), 2, "valid: 1, 2, 4, 8, 16"),
    (dict(strategy="zero9"), 1, "'zero9' is not valid; choose one of: single, ddp, zero1, zero2, zero3, "
                                "zero2-offload, zero3-offload"),
    (dict(max_steps=-3), 1, "--max-steps must be a positive integer, got -3"),
    (dict(nproc=0), 1, "--nproc must be at least 1, got 0"),
    (dict(precision="fp8"), 1, "'fp8'"),
])
def test_resolve_errors_name_the_value(kw, world, needle):
    with pytest.raises(BigfitError, match=needle.replace("(", r"\(")):
        validate(TrainConfig(**kw))  # the settings' gate, then the job's
        resolve(TrainConfig(**kw), world)


def test_lr_schedules():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, max_steps=12)
    lrs = [lr_at(s, cfg) for s in range(12)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[-1] == pytest.approx(1 / 8) and all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    cos = [lr_at(s, TrainConfig(lr=1.0, warmup_steps=4, max_steps=12, lr_schedule="cosine")) for s in range(12)]
    assert cos[4] == 1.0 and cos[8] == pytest.approx(0.5) and cos[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    # DeepSpeed WarmupLR: log warm-up from warmup_min_lr, then constant
    ds = TrainConfig(lr=1.0, warmup_steps=9, warmup_type="log", warmup_min_lr=0.1, lr_schedule="constant")
    assert lr_at(0, ds) == 0.1 and lr_at(2, ds) == pytest.approx(0.1 + 0.9 * math.log(3) / math.log(9))
    assert lr_at(8, ds) == pytest.approx(1.0) and lr_at(500, ds) == 1.0
    # DeepSpeed WarmupDecayLR: down to warmup_min_lr at the end, not to 0
    decay = TrainConfig(lr=1.0, warmup_steps=2, max_steps=10, min_lr=0.2)
    assert lr_at(2, decay) == 1.0 and lr_at(6, decay) == pytest.approx(0.6) and lr_at(10, decay) == pytest.approx(0.2)


def test_loss_scaler_follows_deepspeed():
    from bigfit.common.precision import LossScaler

    s = LossScaler.from_config(TrainConfig(precision="fp16", initial_scale_power=4, loss_scale_window=3,
                                           hysteresis=2, min_loss_scale=2))
    assert s.scale == 16
    s.update(True)  # first overflow is tolerated (hysteresis 2)
    assert (s.scale, s.overflows) == (16, 1)
    s.update(True)  # second halves
    assert s.scale == 8
    s.update(True)  # hysteresis is used up until the scale grows again
    assert s.scale == 4
    for _ in range(3):
        s.update(False)
    assert s.scale == 8  # a window of good steps doubles it and restores the hysteresis
    s.update(True)
    assert s.scale == 8
    for _ in range(6):
        s.update(True)
    assert s.scale == 2 and s.alarm  # floored at min_loss_scale, and the loop raises the alarm
    static = LossScaler.from_config(TrainConfig(precision="fp16", loss_scale=128))
    static.update(True)
    assert (static.scale, static.overflows, static.dynamic) == (128, 1, False)


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

    from bigfit.models.source import block_lists

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


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_buckets_split_rows_as_dtensor_shards_and_round_trip(world):
    """The engine's layout: rank r's part of each parameter is its Shard(0) rows (uneven ones too), and
    packing full tensors then unpacking them gives them back."""
    import torch

    from bigfit.offload.buckets import local_view, make_buckets, pack, unpack

    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((5, 3), (4,), (1, 2), (7, 2, 2))]
    bucket, = make_buckets([[(f"p{i}", p) for i, p in enumerate(params)]], world)
    flat = torch.zeros(world, bucket.numel)
    for s in bucket.slots:
        pack(flat, s, s.param.detach(), accumulate=False)
    for s in bucket.slots:
        chunks = torch.tensor_split(s.param.detach(), [r * s.rows for r in range(1, world)])
        for rank in range(world):
            assert torch.equal(local_view(flat[rank], s, rank), chunks[rank])
        out = torch.empty_like(s.param)
        unpack(flat, s, out)
        assert torch.equal(out, s.param)


def test_training_says_once_when_the_gpu_allocator_starts_flushing_its_cache():
    from bigfit.training.metrics import FlushWatch

    counts = iter([3, 4, 4, 4, 6, 9])  # the allocator's count: at the start, then after steps 1-5
    watch = FlushWatch(lambda: next(counts))
    records = [{} for _ in range(5)]
    said = [watch.update(r, step, micro=192) for step, r in enumerate(records, 1)]
    assert [r["allocator_flushes"] for r in records] == [4, 4, 4, 6, 9]
    assert said[:3] == [None] * 3  # steps 1-2 make the optimizer states; step 3 flushed nothing
    assert said[3].startswith("step 4: the GPU allocator flushed its cache 2 time(s)") and "below 192" in said[3]
    assert said[4] is None  # said once
