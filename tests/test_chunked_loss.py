"""The head's loss in chunks (engine/chunkloss.py) and the context-parallel slicing rules (context/split.py),
in one process: values and gradients against the whole-logits loss, the chunks really taken, and the
mistakes a long-sequence job can make, each one line before any work."""
from __future__ import annotations

import pytest
import torch

from bigfit.context.split import gathered_order, local_positions, shifted_labels, split_batch
from bigfit.engine.chunkloss import chunked_head
from bigfit.engine.losses import token_loss
from bigfit.errors import BigfitError
from bigfit.layout.activations import loss_chunk_tokens
from bigfit.layout.plan import plan_for
from tiny import twin_models


def test_auto_chunks_only_where_the_whole_logits_pass_a_gibibyte():
    assert loss_chunk_tokens(None, 2048, 32000) == 0  # 262 MB of fp32 logits
    assert loss_chunk_tokens(None, 131072, 128256) == (1 << 30) // (4 * 128256)  # 2,093 tokens a chunk
    assert loss_chunk_tokens(0, 131072, 128256) == 0 and loss_chunk_tokens(512, 100, 10) == 0
    assert loss_chunk_tokens(512, 4096, 10) == 512


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_chunked_loss_equals_the_whole_logits_loss_in_value_and_gradients(family):
    ref, model = twin_models(family)
    ids = torch.randint(2, 384, (3, 23))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt without loss
    whole = token_loss(ref(input_ids=ids).logits, labels, seq2seq=False)
    whole.backward()
    head = chunked_head(model, 5)
    calls = []
    forward = head.forward
    head.forward = lambda h: calls.append(h.shape[1]) or forward(h)
    with head.computing(shifted_labels(labels), head.tokens_for(labels.numel())):
        chunked = model(input_ids=ids).logits.reshape(())
    assert calls == [1] * 23  # 5 tokens over 3 rows: one position of each row a chunk, no whole logits
    chunked.backward()
    assert torch.allclose(chunked, whole, rtol=1e-6, atol=0)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):  # 1e-6 of the largest gradient
        assert (a.grad - b.grad).abs().max() <= 1e-6 * a.grad.abs().max(), name
    head.remove()
    assert "forward" not in model.get_output_embeddings().__dict__  # the head it was


def test_each_rank_holds_one_chunk_from_either_end_and_the_gather_restores_the_order():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7] and local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([local_positions(24, 3, r) for r in range(3)])
    assert held[gathered_order(24, 3)].tolist() == list(range(24))


def test_a_slice_pads_the_sequence_and_shifts_its_labels_over_the_whole():
    ids = torch.arange(1, 8)[None]  # 7 tokens: padded to 8 for 2 ranks
    piece = split_batch({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}, 2, 1)
    assert piece.inputs["input_ids"].tolist() == [[3, 4, 5, 6]] and piece.targets.tolist() == [[4, 5, 6, 7]]
    assert piece.inputs["position_ids"].tolist() == [[2, 3, 4, 5]] and piece.length == 8
    packed = split_batch({"input_ids": ids[:, :6], "labels": ids[:, :6], "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}, 2, 0)
    assert packed.documents.tolist() == [[1, 1, 1, 2, 2, 2, 2, 2]]  # padding joins the last sample, after it


@pytest.mark.parametrize("strategy,degrees,needle", [
    ("zero2-offload", dict(cp=2), "the offload engine reduces over data-parallel ranks only"),
    ("zero1", dict(cp=2), "--cp 2 with zero1"),
    ("zero3", dict(cp=2, pp=2), "--cp 2 with --pp 2"),
    ("zero3", dict(cp=2, tp=2, sequence_parallel=True), "--sequence-parallel with --cp"),
    ("device_map", dict(cp=2), "--cp 2 splits each sequence over processes, but device_map runs one process")])
def test_layouts_cp_cannot_serve_are_one_line(strategy, degrees, needle):
    with pytest.raises(BigfitError) as e:
        plan_for(strategy, 1 if strategy == "device_map" else 4, **degrees)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_an_encoder_decoder_cannot_split_its_sequences():
    from bigfit.context import check_context_model
    from tiny import tiny_config

    with pytest.raises(BigfitError, match="encoder-decoder"):
        check_context_model(tiny_config("t5"), 2)
    check_context_model(tiny_config("llama"), 2)


def test_prepare_refuses_cp_in_the_users_own_loop():
    import bigfit

    ref, _ = twin_models("llama")
    with pytest.raises(BigfitError, match="cp=2 splits each sequence"):
        bigfit.prepare(ref, cp=2)


@pytest.mark.parametrize("settings,needle", [
    (dict(activations="bogus"), "--activations"),
    (dict(activations="keep", activation_checkpointing=True), "give one"),
    (dict(activations="keep", checkpoint_blocks=2), "--checkpoint-blocks 2"),
    (dict(loss_chunk=-1), "--loss-chunk must be")])
def test_activation_settings_mistakes_are_one_line(settings, needle):
    from bigfit.job.checks import validate
    from bigfit.settings.config import TrainConfig

    with pytest.raises(BigfitError) as e:
        validate(TrainConfig(**settings))
    assert needle in str(e.value) and "\n" not in str(e.value)
