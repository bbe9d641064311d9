"""Packing (`--pack`): short samples laid end to end into full sequences, attention and positions kept
within each. The packed loss and gradients are those of the same samples unpacked; packed training
on 2 ranks (data parallel, FSDP2, a pipeline, tensor x sequence parallel) matches one process packed;
running text is cut per document; an encoder-decoder is refused in one line."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import bigfit, one_line
from dist import run_ranks, threads_per_rank, torch_threads
from test_parity import TOL, compare, job
from tiny import tiny_config

# (family, strategy, degrees) on 2 ranks, each against one process packed
CASES = [("gpt2", "ddp", {}), ("llama", "zero3", {}), ("llama", "pipeline", {}),
         ("llama", "ddp", dict(tp=2, sequence_parallel=True))]


def _samples(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:  # a prompt (no loss) then an answer, as tokenize.py makes decoder-only pairs
        ids = torch.randint(5, 300, (n,), generator=g).tolist()
        cut = max(1, n // 3)
        out.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_packed_batch_gives_the_loss_and_gradients_of_its_samples_unpacked(family):
    from transformers import AutoModelForCausalLM

    from bigfit.data import collate
    from bigfit.data.pack import pack
    from bigfit.engine.losses import model_logits, token_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family))
    samples = _samples([5, 9, 3, 12, 7, 2, 6])
    packed = pack([{**s, "labels": [-100, *s["labels"][1:]]} for s in samples], 16)
    assert [p["parts"] for p in packed] == [[5, 9], [3, 12], [7, 2, 6]]  # next fit, in order

    def loss_and_grads(items):
        model.zero_grad()
        batch = collate(items, pad_id=0)
        loss = token_loss(model_logits(model, model, batch, False), batch["labels"], False)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    (plain, plain_grads), (got, got_grads) = loss_and_grads(samples), loss_and_grads(packed)
    assert got == pytest.approx(plain, rel=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(plain_grads, got_grads)) < 1e-5


def test_running_text_is_cut_per_document_when_packed():
    from transformers import ByT5Tokenizer

    from bigfit.data import build_dataset

    docs = [{"text": "a" * 30}, {"text": "b" * 7}, {"text": "c" * 50}]  # ByT5: a token a byte, then </s>
    kw = dict(max_source_len=16, max_target_len=16, eval_samples=0, seed=0, min_train=1)
    tok = ByT5Tokenizer()
    plain = build_dataset(docs, tok, False, **kw)
    packed = build_dataset(docs, tok, False, pack=True, **kw)
    assert [len(s["input_ids"]) for s in plain.train] == [16] * 5  # 90 tokens run together, the last 10 dropped
    parts = [n for s in packed.train for n in s["parts"]]
    assert sorted(parts) == sorted([16, 15, 8, 16, 16, 16, 3])  # each document's blocks, its last shorter
    assert all(sum(s["parts"]) <= 16 for s in packed.train) and packed.packed == 7
    a_ids = [t for s in packed.train for t in s["input_ids"] if t == tok("a")["input_ids"][0]]
    assert len(a_ids) == 30  # no token lost or repeated


def _packed_job(model_dir, data, out, strategy: str, degrees: dict):
    return dataclasses.replace(job(model_dir, data, out, strategy, "fp32"), pack=True, max_source_len=64, **degrees)


def _run_cases(model_dirs, data, root):
    from dist import train

    for family, strategy, degrees in CASES:
        train(_packed_job(model_dirs[family], data, root / f"{family}-{strategy}-{len(degrees)}", strategy, degrees))


def _run_references(model_dirs, data, root):
    from dist import train

    with torch_threads(threads_per_rank(2)):
        for family in sorted({c[0] for c in CASES}):
            train(_packed_job(model_dirs[family], data, root / f"{family}-single", "single", {}))


@pytest.fixture(scope="module")
def packed_runs(model_dirs, pairs_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    run_ranks(_run_cases, 2, model_dirs, pairs_file, root, meanwhile=lambda: _run_references(model_dirs, pairs_file, root))
    return root


@pytest.mark.parametrize("family,strategy,degrees", CASES)
def test_packed_training_on_two_ranks_matches_one_process(packed_runs, family, strategy, degrees):
    ref, got = packed_runs / f"{family}-single", packed_runs / f"{family}-{strategy}-{len(degrees)}"
    compare(ref, got, "fp32", f"{family} packed {strategy} {degrees}", TOL["fp32"])


def test_pairs_fill_their_sequences_and_keep_every_token(model_dirs, pairs_file):
    from bigfit.settings.config import TrainConfig
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import prepare

    cfg = TrainConfig(model=str(model_dirs["llama"]), data=str(pairs_file), max_source_len=64, batch_size=8)
    plain, packed = prepare(resolve(cfg, 1)).dataset, prepare(resolve(dataclasses.replace(cfg, pack=True), 1)).dataset
    assert packed.packed == len(plain.train) and len(packed.train) < len(plain.train) / 2
    for this, after in zip(packed.train, packed.train[1:]):  # none could take the next sample
        assert len(this["input_ids"]) == sum(this["parts"]) <= 64 < sum(this["parts"]) + after["parts"][0]
    assert [t for s in packed.train for t in s["input_ids"]] == [t for s in plain.train for t in s["input_ids"]]
    assert packed.eval == plain.eval  # generation evaluates the held-out samples one by one


def test_an_encoder_decoder_is_refused_in_one_line(model_dirs, pairs_file, tmp_path):
    r = bigfit("train", "--model", model_dirs["t5"], "--data", pairs_file, "--pack", "--output-dir", tmp_path / "o")
    assert r.returncode == 2
    assert "--pack" in one_line(r.stderr) and "encoder-decoder" in r.stderr
    assert not (tmp_path / "o").exists()
