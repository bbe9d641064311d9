"""Parity: DDP and ZeRO-3 (FSDP2) on 2 gloo ranks against the single-process reference, on T5, GPT-2 and a
Llama-style model, through the real training loop: same global batch, same data, same seed.

Tolerances: the two runs differ only in summation order (per-rank partial sums, reduce-scatter),
which moved fp32 losses by at most 5e-8 relative and parameters after 4 AdamW steps by at most
2.1e-6 (measured on torch 2.13, CPU: AdamW turns tiny gradient differences on near-zero gradients into
visible update differences); the tolerances keep a 10x margin.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAMILIES, read_jsonl
from dist import run_ranks

LOSS_RTOL = 1e-6
PARAM_ATOL = 2e-5
DISTRIBUTED = ("ddp", "zero3")


def job(model_dir, data, out, strategy: str):
    from bigfit.config import TrainConfig

    return TrainConfig(model=str(model_dir), data=str(data), output_dir=str(out), strategy=strategy,
                       max_steps=4, batch_size=8, micro_batch_size=2, warmup_steps=0, eval_every=0,
                       save_every=0, eval_samples=8, num_beams=2, max_new_tokens=8)


def train_families(model_dirs, data, root, strategy):
    from bigfit.train.loop import train

    for family in FAMILIES:
        train(job(model_dirs[family], data, root / f"{family}-{strategy}", strategy))


def train_strategies(model_dirs, data, root, strategies):
    for strategy in strategies:
        train_families(model_dirs, data, root, strategy)


@pytest.fixture(scope="module")
def runs(model_dirs, pairs_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    run_ranks(train_strategies, 2, model_dirs, pairs_file, root, DISTRIBUTED)  # one launch for all cases
    train_families(model_dirs, pairs_file, root, "single")
    return root


@pytest.mark.parametrize("strategy", DISTRIBUTED)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_single_process(runs, family, strategy):
    ref, got = runs / f"{family}-single", runs / f"{family}-{strategy}"
    ref_losses = [r["loss"] for r in read_jsonl(ref / "metrics.jsonl")]
    got_losses = [r["loss"] for r in read_jsonl(got / "metrics.jsonl")]
    assert len(ref_losses) == 4
    assert got_losses == pytest.approx(ref_losses, rel=LOSS_RTOL)
    assert ref_losses[-1] < ref_losses[0]  # it trained
    ref_params, got_params = load_file(ref / "model" / "model.safetensors"), load_file(got / "model" / "model.safetensors")
    assert ref_params.keys() == got_params.keys()
    worst = max((ref_params[k] - got_params[k]).abs().max().item() for k in ref_params)
    print(f"{family} {strategy}: max loss rel diff {max(abs(a - b) / a for a, b in zip(ref_losses, got_losses)):.1e}, "
          f"max param diff {worst:.1e}")
    assert worst <= PARAM_ATOL, f"largest parameter difference {worst:.2e}"
    # the evaluation (loss over held-out samples, sharded over ranks) agrees as well
    ref_eval, got_eval = read_jsonl(ref / "eval.jsonl")[-1], read_jsonl(got / "eval.jsonl")[-1]
    assert got_eval["eval_loss"] == pytest.approx(ref_eval["eval_loss"], rel=LOSS_RTOL)


def test_tied_embeddings_stay_tied(runs):
    params = load_file(runs / "t5-zero3" / "model" / "model.safetensors")
    assert "shared.weight" in params and "lm_head.weight" not in params  # written once
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(runs / "t5-zero3" / "model")
    assert model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr()
    assert torch.equal(model.shared.weight, params["shared.weight"])
