"""Activation offload (engine/actoffload.py): checkpointed blocks whose inputs wait in host RAM for
their recompute. On the CPU the copy is a plain clone, so what is checked is the path itself: the
handle lets go of the device input, the recompute reads the host copy, each block's recompute
prefetches the one before, and training is bit-identical to plain checkpointing (the recompute sees
the same values), through `bigfit train` on one process and on 2 ranks under zero3 and tensor x
sequence parallel (the residual stream a DTensor)."""
from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from conftest import read_jsonl
from dist import run_ranks
from test_parity import job
from tiny import twin_models

from bigfit.engine import actoffload
from bigfit.engine.checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from bigfit.models.source import block_lists

FAMILIES = ("llama", "gpt2")
STEPS, BATCH = 2, 4  # micro-batches of 2: 2 a step on one process
CASES = (("checkpoint", None), ("offload", None), ("offload", 1))  # (activations, checkpoint_blocks)


def batch(seed: int = 0) -> dict:
    ids = torch.randint(2, 384, (2, 12), generator=torch.Generator().manual_seed(seed))
    return dict(input_ids=ids, labels=ids, use_cache=False)


def blocks(model) -> list:
    return list(block_lists(model)[0][1])


def owner_of(model) -> actoffload.ActivationOffload:
    return next(b.forward.owner for b in blocks(model)
                if isinstance(b.__dict__.get("forward"), actoffload.OffloadedForward))


def handles(monkeypatch) -> list:
    """Weak references to every handle (an offloaded block input) made from now on."""
    made = []

    class Recorded(actoffload._Saved):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(weakref.ref(self))

    monkeypatch.setattr(actoffload, "_Saved", Recorded)
    return made


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", (None, 1))
def test_gradients_equal_plain_checkpointing(family, n):
    ref, model = twin_models(family)
    assert apply_activation_checkpointing(ref, n) == apply_activation_checkpointing(model, n, offload=True) == (n or 2)
    loss_ref, loss = ref(**batch()).loss, model(**batch()).loss
    loss_ref.backward()
    loss.backward()
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()))
    counts = owner_of(model).counts  # every offloaded input came back once; all but the first prefetched
    assert counts == {"offloaded": n or 2, "restored": n or 2, "prefetched": (n or 2) - 1}


def test_hidden_states_by_keyword():
    """A block called with `hidden_states=`: the input that moves, its gradient as checkpointing's."""
    ref, model = twin_models("llama")
    apply_activation_checkpointing(ref)
    apply_activation_checkpointing(model, offload=True)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    position = model.model.rotary_emb(x, position_ids=torch.arange(5)[None])
    inputs = [x.clone().requires_grad_() for _ in range(2)]
    out_ref = blocks(ref)[0](inputs[0], position_embeddings=position, attention_mask=None)
    out = blocks(model)[0](hidden_states=inputs[1], position_embeddings=position, attention_mask=None)
    (out_ref.sum()).backward()
    (out.sum()).backward()
    assert torch.equal(out, out_ref) and torch.equal(inputs[1].grad, inputs[0].grad)
    assert owner_of(model).counts == {"offloaded": 1, "restored": 1, "prefetched": 0}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_device_input_is_let_go_and_the_recompute_reads_the_host_copy(family, monkeypatch):
    _, model = twin_models(family)
    seen = []  # block 1's input, held weakly: the output of block 0, which the model's loop drops
    blocks(model)[1].register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0])))  # positional
    apply_activation_checkpointing(model)
    loss = model(**batch()).loss
    assert seen[0]() is not None  # plain checkpointing keeps it for the recompute
    del loss
    remove_activation_checkpointing(model)

    apply_activation_checkpointing(model, offload=True)
    marks = handles(monkeypatch)
    loss = model(**batch()).loss
    assert seen[1]() is None  # gone from the device: only the host copy is left
    saved = [ref() for ref in marks]
    assert all(s is not None and s._x is None and s.host is not None for s in saved)
    for s in saved:
        s.host.zero_()  # the recompute must read these: zeros change every gradient of the blocks
    loss.backward()
    assert owner_of(model).counts == {"offloaded": 2, "restored": 2, "prefetched": 1}
    _, clean = twin_models(family)
    clean(**batch()).loss.backward()
    block_grads = [[p.grad for p in blocks(m)[0].parameters()] for m in (model, clean)]
    assert not any(torch.equal(a, b) for a, b in zip(*block_grads))
    del saved, s, loss
    assert all(ref() is None for ref in marks)  # freed with the graph (pinned buffers back in the pool)


def test_remove_restores_forward_and_no_grad_saves_nothing():
    ref, model = twin_models("llama")
    names = list(model.state_dict())
    apply_activation_checkpointing(model, offload=True)
    with torch.no_grad():  # evaluation: nothing to recompute, nothing copied out
        assert torch.equal(model(**batch()).logits, ref(**batch()).logits)
    assert not owner_of(model).counts
    remove_activation_checkpointing(model)
    assert all("forward" not in b.__dict__ for b in blocks(model)) and list(model.state_dict()) == names
    assert torch.equal(model(**batch()).loss, ref(**batch()).loss)


def losses(out) -> list[float]:
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]


def train_both(model_dir, data, root, strategy: str, cases=CASES, **degrees) -> dict:
    """`bigfit train` with activations checkpoint, then offload on all blocks and on the first only
    (`cases`); the offloads' counts (this process's) by checkpoint_blocks."""
    from dist import train

    made = []
    real = actoffload.ActivationOffload.__init__

    def recorded(self):
        real(self)
        made.append(self)

    actoffload.ActivationOffload.__init__ = recorded
    try:
        for how, n in cases:
            cfg = job(model_dir, data, root / f"{strategy}-{how}-{n}", strategy, "fp32")
            train(dataclasses.replace(cfg, activation_checkpointing=False, activations=how, checkpoint_blocks=n,
                                      eval_samples=0, max_steps=STEPS, batch_size=BATCH, **degrees))
    finally:
        actoffload.ActivationOffload.__init__ = real
    return {n: dict(o.counts) for (_, n), o in zip(cases[1:], made)}


def assert_same_run(root, strategy: str, counts: dict, micro_batches: int) -> None:
    from safetensors.torch import load_file

    ref = root / f"{strategy}-checkpoint-None"
    for n in counts:
        got = root / f"{strategy}-offload-{n}"
        assert len(losses(ref)) == STEPS and losses(got) == losses(ref)
        ref_params, got_params = (load_file(r / "model" / "model.safetensors") for r in (ref, got))
        assert all(torch.equal(ref_params[k], got_params[k]) for k in ref_params)
        per_batch = n or 2  # Llama's 2 blocks
        assert counts[n] == {"offloaded": per_batch * micro_batches, "restored": per_batch * micro_batches,
                             "prefetched": (per_batch - 1) * micro_batches}, counts


@pytest.mark.parametrize("family", FAMILIES)
def test_training_is_bit_identical_to_checkpointing(family, model_dirs, pairs_file, tmp_path):
    counts = train_both(model_dirs[family], pairs_file, tmp_path, "single")
    assert_same_run(tmp_path, "single", counts, micro_batches=STEPS * 2)


def on_ranks(model_dir, data, root) -> dict:
    cases = CASES[:2]  # all blocks offloaded: the one-process tests cover checkpoint_blocks
    return {"zero3": train_both(model_dir, data, root, "zero3", cases),
            "tp2-sp": train_both(model_dir, data, root, "ddp", cases, tp=2, sequence_parallel=True)}


def test_two_ranks_zero3_and_sequence_parallel(model_dirs, pairs_file, tmp_path):
    results = run_ranks(on_ranks, 2, model_dirs["llama"], pairs_file, tmp_path)
    for counts in results:  # rank 0 writes the runs; each rank counts its own offloads
        assert_same_run(tmp_path, "zero3", counts["zero3"], micro_batches=STEPS)  # 2 samples a rank
        assert_same_run(tmp_path, "ddp", counts["tp2-sp"], micro_batches=STEPS * 2)  # tensor-parallel peers read all 4
