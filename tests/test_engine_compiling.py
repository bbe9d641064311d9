"""--compile: each block's forward compiled for training (engine/compiling.py). A backend that
counts graphs and runs them as traced stands in for inductor, whose code generation takes minutes
on two cores: what is checked is what bigfit decides (which forwards are compiled, when, one graph
per kind of block, the model restored afterwards) and that compiled training changes no number."""
import json

import pytest
import torch

from bigfit.engine.checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from bigfit.engine.compiling import apply_compile, remove_compile
from bigfit.models.source import block_lists
from tiny import twin_models

KINDS = {"t5": 4, "llama": 1, "gpt2": 1}  # T5: the first block of each stack makes its position bias


def counting_backend():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return graphs, backend


def batch(family: str) -> dict:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 300, (7, 9), generator=g)
    labels = torch.randint(2, 300, (7, 5), generator=g) if family == "t5" else ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # graphs of earlier tests' models would serve these (same block classes)
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", list(KINDS))
def test_compiled_training_equals_eager_with_one_graph_per_kind_of_block(family):
    ref, model = twin_models(family)
    graphs, backend = counting_backend()
    assert apply_compile(model, backend) == sum(len(blocks) for _, blocks in block_lists(model))
    for rows in (7, 6):  # another batch size: the same graphs (dynamic shapes; sizes unlike the model's own)
        b = {**{k: v[:rows] for k, v in batch(family).items()}, "use_cache": False}  # as bigfit trains
        model.zero_grad()
        ref.zero_grad()
        loss = model(**b).loss
        loss.backward()
        expected = ref(**b).loss
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grads(model), grads(ref), rtol=1e-6, atol=1e-7)
    assert 1 <= len(graphs) <= KINDS[family]


def test_evaluation_and_generate_run_the_plain_forward():
    ref, model = twin_models("t5")
    graphs, backend = counting_backend()
    apply_compile(model, backend)
    b = batch("t5")
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(**b).logits, ref(**b).logits, rtol=0, atol=0)
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    def generate(m):  # a cache that grows per layer: the decoder is deeper than the encoder
        return m.generate(input_ids=b["input_ids"], num_beams=2, max_new_tokens=4, do_sample=False,
                          past_key_values=EncoderDecoderCache(DynamicCache(), DynamicCache()))
    assert torch.equal(generate(model), generate(ref))
    model.train()
    with torch.no_grad():
        model(**b)
    assert graphs == []


def test_remove_compile_restores_each_forward_also_under_checkpointing():
    _, model = twin_models("llama")
    blocks = list(model.model.layers)
    apply_compile(model)
    remove_compile(model)
    assert all("forward" not in blk.__dict__ for blk in blocks)  # the class's own forward again
    apply_activation_checkpointing(model)  # the documented order: checkpointing, then compile
    checkpointed = [blk.__dict__["forward"] for blk in blocks]
    apply_compile(model)
    remove_compile(model)
    assert [blk.__dict__["forward"] for blk in blocks] == checkpointed
    remove_activation_checkpointing(model)
    assert all("forward" not in blk.__dict__ for blk in blocks)


def test_train_command_compile_with_device_map_chunks_matches_eager(tmp_path):
    """The block forwards run on the chunked schedule's threads, under checkpointing, with dynamo
    tracing them (backend eager: no code generation)."""
    from bigfit.cli import main
    from conftest import read_jsonl

    spec = {"encoder": {"cpu": [0], "cpu:1": [1, 2]}, "decoder": {"cpu:2": [0, 1]}}
    (tmp_path / "map.json").write_text(json.dumps(spec))
    common = ["--strategy", "device_map", "--device-map", str(tmp_path / "map.json"), "--chunks", "2",
              "--activation-checkpointing", "--max-steps", "2", "--batch-size", "4", "--eval-every", "0",
              "--eval-samples", "4", "--num-beams", "2", "--max-new-tokens", "4", "--no-consolidate", "--seed", "3"]
    assert main(["train", *common, "--output-dir", str(tmp_path / "eager")]) == 0
    from torch._dynamo.utils import counters

    counters.clear()  # torch._dynamo.reset() keeps them
    assert main(["train", *common, "--compile", "--compile-backend", "eager", "--output-dir", str(tmp_path / "c")]) == 0
    assert counters["stats"]["unique_graphs"] >= 4  # the blocks were traced, in the chunks' threads
    eager, compiled = read_jsonl(tmp_path / "eager/metrics.jsonl"), read_jsonl(tmp_path / "c/metrics.jsonl")
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=1e-6)
    assert read_jsonl(tmp_path / "c/eval.jsonl")[-1]["eval_loss"] == pytest.approx(
        read_jsonl(tmp_path / "eager/eval.jsonl")[-1]["eval_loss"], rel=1e-6)
