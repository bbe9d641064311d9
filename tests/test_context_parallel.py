"""Long sequences: context parallelism (--cp) and the chunked loss (--loss-chunk) against one process.

Each run trains 3 steps of the real loop (2 micro-batches a step, AdamW, clipping, fp32) on 2 or 4
gloo ranks; the reference is `single` on the same data, seed and global batch. Context-parallel ranks
each hold two chunks of every sequence (one from either end) and gather keys and values over the cp
group: Llama-style (rotary, grouped-query), Qwen2-style (rotary, biases on q/k/v) and GPT-2 (learned
positions, Conv1D), packed (position ids restart per sample: attention kept inside each) and padded.
Compositions: FSDP2 over dp_shard x cp, DDP over cp, TP inside cp, LoRA. The chunked loss computes
the head and its loss 8 tokens at a time on every engine that computes a loss (the plain model, DDP,
FSDP2, the offload engine, the vocabulary-split head of TP).
Tolerances: the parity suite's fp32 ones (test_parity.py), about 10x the worst measured here."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file
from transformers import Qwen2Config

from conftest import read_jsonl
from dist import run_ranks, threads_per_rank, torch_threads

TOL = (1e-6, 2e-5)  # (loss relative, parameter absolute), fp32
# (name, family, settings) on 2 ranks, then on 4
TWO = [("cp2-zero3-ac", "llama", dict(strategy="zero3", cp=2, activations="checkpoint")),
       ("cp2-zero3-packed", "llama", dict(strategy="zero3", cp=2, pack=True)),
       ("cp2-ddp-packed", "qwen2", dict(strategy="ddp", cp=2, pack=True)),
       ("cp2-zero2", "gpt2", dict(strategy="zero2", cp=2)),
       ("cp2-zero3-packed", "gpt2", dict(strategy="zero3", cp=2, pack=True)),
       ("cp2-lora", "llama", dict(strategy="zero3", cp=2, lora=True, lr=1e-2)),
       ("chunk-ddp", "gpt2", dict(strategy="ddp", loss_chunk=8)),
       ("chunk-zero3", "llama", dict(strategy="zero3", loss_chunk=8)),
       ("chunk-offload", "llama", dict(strategy="zero2-offload", loss_chunk=8)),
       ("chunk-tp2", "llama", dict(strategy="zero3", tp=2, loss_chunk=8)),
       ("chunk-cp2", "qwen2", dict(strategy="zero3", cp=2, loss_chunk=8))]
FOUR = [("cp4-zero3-packed", "llama", dict(strategy="zero3", cp=4, pack=True)),
        ("cp2-dp2", "llama", dict(strategy="zero3", cp=2)),
        ("cp2-hsdp", "qwen2", dict(strategy="zero3", cp=2, dp_replicate=2, dp_shard=1)),
        ("cp2-tp2", "llama", dict(strategy="zero3", cp=2, tp=2))]


def qwen2_config():
    return Qwen2Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)


def job(model_dir, data, out, settings: dict):
    from bigfit.settings.config import TrainConfig

    lora = dict(lora_r=4, lora_alpha=8, lora_targets="q_proj,v_proj", lora_dropout=0.0) if settings.get("lora") else {}
    return TrainConfig(model=str(model_dir), data=str(data), output_dir=str(out), precision="fp32", max_steps=3,
                       batch_size=8, micro_batch_size=2, warmup_steps=0, eval_every=0, eval_on_start=False,
                       save_every=0, eval_samples=4, **lora, **settings)


def reference_of(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k in ("pack", "lora", "lr")}


def run_cases(dirs, data, root, cases) -> None:
    from dist import train

    for name, family, settings in cases:
        train(job(dirs[family], data, root / f"{family}-{name}", settings))


def run_references(dirs, data, root) -> None:
    from dist import train

    with torch_threads(threads_per_rank(2)):
        done = set()
        for _, family, settings in TWO + FOUR:
            ref = reference_of(settings)
            key = (family, tuple(sorted(ref)))
            if key not in done:
                done.add(key)
                train(job(dirs[family], data, root / ref_name(family, settings), dict(strategy="single", **ref)))


def ref_name(family: str, settings: dict) -> str:
    return f"{family}-single" + "".join(f"-{k}" for k in sorted(reference_of(settings)))


@pytest.fixture(scope="module")
def runs(model_dirs, pairs_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("context")
    dirs = dict(model_dirs)
    qwen2_config().save_pretrained(root / "qwen2")
    dirs["qwen2"] = root / "qwen2"
    run_ranks(run_cases, 2, dirs, pairs_file, root, TWO, meanwhile=lambda: run_references(dirs, pairs_file, root))
    run_ranks(run_cases, 4, dirs, pairs_file, root, FOUR)
    return root


def compare(ref, got, label: str) -> None:
    ref_losses = [r["loss"] for r in read_jsonl(ref / "metrics.jsonl")]
    got_losses = [r["loss"] for r in read_jsonl(got / "metrics.jsonl")]
    assert len(ref_losses) == 3 and ref_losses[-1] < ref_losses[0]  # it trained
    ref_eval, got_eval = (read_jsonl(p / "eval.jsonl")[-1]["eval_loss"] for p in (ref, got))
    weights = "adapter/adapter_model.safetensors" if (ref / "adapter").is_dir() else "model/model.safetensors"
    ref_params, got_params = (load_file(p / weights) for p in (ref, got))
    assert ref_params.keys() == got_params.keys()
    loss_diff = max(abs(a - b) / a for a, b in zip(ref_losses + [ref_eval], got_losses + [got_eval]))
    worst = max((ref_params[k] - got_params[k]).abs().max().item() for k in ref_params)
    print(f"{label}: max loss rel diff {loss_diff:.1e}, max param diff {worst:.1e}")
    assert loss_diff <= TOL[0], f"losses {got_losses} vs {ref_losses}"
    assert worst <= TOL[1], f"largest parameter difference {worst:.2e}"


@pytest.mark.parametrize("name,family,settings", TWO + FOUR, ids=[f"{f}-{n}" for n, f, _ in TWO + FOUR])
def test_matches_one_process(runs, name, family, settings):
    compare(runs / ref_name(family, settings), runs / f"{family}-{name}", f"{family} {name}")
