"""Device-map model parallelism (bigfit.device_map): maps and their errors, the balancer, reversible
hooks, equal losses / gradients / generated tokens, copy counts, and the chunked (GPipe) schedule.

Placements: on a CPU machine A, B, C are "cpu", "cpu:1", "cpu:2" (virtual CPU devices: real copies,
counted, scheduled as devices); with CUDA the same tests also run with A = cuda:0, B = cpu, and
with two GPUs with A = cuda:0, B = cuda:1, C = cpu.
"""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

from bigfit.device_map import count_copies, deparallelize, parallelize, run_chunks, split_batch, train_step
from bigfit.errors import BigfitError
from bigfit.layout.maps import real_device
from bigfit.planning.search import Workload
from tiny import tiny_config, twin_models

PLACES = ([("cpu", "cpu:1", "cpu:2")] + ([("cuda:0", "cpu", "cpu:1")] if torch.cuda.is_available() else [])
          + ([("cuda:0", "cuda:1", "cpu")] if torch.cuda.device_count() > 1 else []))  # GPU -> GPU copy streams
TOL = {"cpu": dict(rtol=1e-6, atol=1e-7), "cuda:0": dict(rtol=1e-4, atol=1e-5)}  # keyed by A  # CUDA kernels differ from CPU's


def batch(family: str, n: int = 6) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (n, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # padding: attention masks are real tensors that must travel
    if family == "t5":
        labels = torch.randint(2, 300, (n, 5), generator=g)
        labels[1, 3:] = -100
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def on(b: dict, device: str) -> dict:
    return {k: v.to(torch.device(device).type) for k, v in b.items()}


LAYOUTS = {  # (family, map over placements A, B, C)
    "t5-flat": ("t5", lambda A, B, C: {"encoder": {A: [0, 1]}, "decoder": {B: [0, 1, 2]}}),
    "t5-split": ("t5", lambda A, B, C: {"encoder": {A: [0], B: [1]}, "decoder": {B: [0, 1], C: [2]}}),
    "gpt2": ("gpt2", lambda A, B, C: {B: [0], A: [1]}),
    "llama": ("llama", lambda A, B, C: {A: [0], B: [1]}),
}


def grads(model) -> dict:
    return {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}



# --- reversible hooks ---------------------------------------------------------------------------------

def _snapshot(model):
    return {"dict": {n: sorted(m.__dict__) for n, m in model.named_modules()},
            "hooks": {n: [len(m._forward_pre_hooks), len(m._forward_hooks)] for n, m in model.named_modules()},
            "params": {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)},
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("places", PLACES)
def test_deparallelize_leaves_the_model_as_before(places):
    ref, model = twin_models("t5")
    before = _snapshot(model)
    parallelize(model, LAYOUTS["t5-split"][1](*places))
    assert model.lm_head.weight is model.shared.weight  # the tie is one parameter, on main
    model(**on(batch("t5"), places[0])).loss.backward()
    model.zero_grad(set_to_none=True)
    deparallelize(model)
    after = _snapshot(model)
    assert after["dict"] == before["dict"] and after["hooks"] == before["hooks"]
    assert after["params"] == before["params"]  # same Parameter objects: ties and optimizers intact
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], before["state"][k]) for k in before["state"])
    assert {p.device.type for p in model.parameters()} == {"cpu"}  # back where it was
    torch.testing.assert_close(model(**batch("t5")).logits, ref(**batch("t5")).logits, rtol=0, atol=0)


# --- equal losses, gradients, tokens ------------------------------------------------------------------

@pytest.mark.parametrize("places", PLACES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_gradients_equal_the_unsplit_model(layout, places):
    family, make = LAYOUTS[layout]
    ref, model = twin_models(family)
    parallelize(model, make(*places))
    b = batch(family)
    out = model(**on(b, places[0]))
    out.loss.backward()
    expected = ref(**b)
    expected.loss.backward()
    tol = TOL[places[0]]
    torch.testing.assert_close(out.loss.cpu(), expected.loss, **tol)
    torch.testing.assert_close(grads(model), grads(ref), **tol)
    for chunks in (1, 2, 4):  # GPipe micro-batches (4 does not divide 6): the same loss and gradients
        model.zero_grad(set_to_none=True)
        loss = train_step(model, on(b, places[0]), chunks=chunks)
        torch.testing.assert_close(loss.cpu(), expected.loss, **tol)
        torch.testing.assert_close(grads(model), grads(ref), **tol)


def _generate(model, b: dict, beams: int):
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())  # grows per layer: decoder deeper than encoder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(input_ids=b["input_ids"], attention_mask=b["attention_mask"], num_beams=beams,
                             max_new_tokens=6, min_new_tokens=6, do_sample=False, past_key_values=cache)
    return out, cache


@pytest.mark.parametrize("places", PLACES)
@pytest.mark.parametrize("beams", [1, 3])
def test_generate_equal_tokens_and_cache_stays_on_its_layer(beams, places):
    ref, model = twin_models("t5")
    ref.eval(), model.eval()
    dmap = parallelize(model, LAYOUTS["t5-split"][1](*places))
    b = batch("t5", n=2)
    expected, _ = _generate(ref, b, beams)
    with count_copies() as c:
        got, cache = _generate(model, on(b, places[0]), beams)
    assert got.tolist() == expected.tolist()
    d_kv, heads = model.config.d_kv, model.config.num_heads
    cache_like = [e for e in c.events if len(e[3]) == 4 and e[3][1] == heads and e[3][-1] == d_kv and e[3][2] > 1]
    assert not cache_like, f"past key/values crossed devices: {cache_like}"
    A, B, C = places
    source_len = [e[1:] for e in c.events if e[3][1:] == (9, model.config.d_model)]
    # encoder block 1 on B and back (before beams are expanded); then the encoder output reaches the
    # decoder devices B and C once for the whole call, not once per step
    assert source_len == [(A, B, (2, 9, 32)), (B, A, (2, 9, 32)), (A, B, (2 * beams, 9, 32)), (A, C, (2 * beams, 9, 32))]
    for i, layer in enumerate(cache.self_attention_cache.layers):  # beams were reordered where each layer lives
        assert layer.keys.device == real_device(dmap.device_of("decoder", i))


# --- copies: the minimum for the placement -----------------------------------------------------------

@pytest.mark.parametrize("places", PLACES)
def test_copies_per_forward_and_backward_are_the_minimum(places):
    A, B, _ = places
    _, model = twin_models("t5")
    parallelize(model, LAYOUTS["t5-flat"][1](*places))  # encoder on main (A), decoder on B
    with count_copies() as c:
        model(**on(batch("t5"), A)).loss.backward()
    fwd = sorted((src, dst, shape) for p, src, dst, shape in c.events if p == "forward")
    # to B, once each: the decoder's embedded input, the encoder output (used by all 3 cross-attentions),
    # and the cross-attention mask; back to A once: the decoder output. Nothing else, no weights.
    assert fwd == sorted([(A, B, (6, 5, 32)), (A, B, (6, 9, 32)), (A, B, (6, 1, 5, 9)), (B, A, (6, 5, 32))])
    bwd = sorted((src, dst, shape) for p, src, dst, shape in c.events if p == "backward")
    assert bwd == sorted([(A, B, (6, 5, 32)), (B, A, (6, 5, 32)), (B, A, (6, 9, 32))])  # gradients of those three
    assert c.forward == 4 and c.backward == 3
    for chunks in (2, 4):  # chunked: each micro-batch's own hops once (no more), 6 rows as 3 + 3 or 2 + 2 + 1 + 1
        b = on(batch("t5"), A)
        with count_copies() as alone:
            for part in split_batch(b, chunks):
                model(**part).loss.backward()
        with count_copies() as c:
            train_step(model, b, chunks=chunks)
        assert sorted(c.events) == sorted(alone.events)
        assert c.forward <= 4 * chunks and c.backward == 3 * chunks  # a micro-batch without padding sends no mask


def test_gradient_from_a_gpu_lands_before_the_cpu_reads_it():
    from bigfit.device_map.moves import _Land
    from bigfit.device_map.streams import Landing

    class Event:  # stands in for the CUDA event of the GPU -> host copy that _Copy's backward starts
        waited = 0

        def synchronize(self):
            Event.waited += 1

    x = torch.ones(3, requires_grad=True)
    landing = Landing()
    y = _Land.apply(x, landing)
    landing.event = Event()
    (2 * y).sum().backward()  # the CPU node waits for the copy's event, once, then hands the gradient on
    assert Event.waited == 1 and landing.event is None and x.grad.tolist() == [2.0] * 3


def test_tied_embeddings_never_travel():
    _, model = twin_models("gpt2")  # wte is tied to lm_head; blocks on two devices
    parallelize(model, {"cpu:1": [0], "cpu:2": [1]}, main_device="cpu")
    with count_copies() as c:
        for _ in range(2):
            model(**batch("gpt2")).loss.backward()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not [e for e in c.events if model.config.vocab_size in e[3]]
    # per step: hidden state, mask and position ids to cpu:1 and cpu:2 each, the hidden state back to cpu;
    # backward: the hidden state's gradient along the same three hops
    assert c.forward == 2 * 7 and c.backward == 2 * 3


# --- the GPipe schedule ------------------------------------------------------------------------------

@pytest.mark.parametrize("places", PLACES)
def test_chunks_run_in_gpipe_order(places):
    A, B, _ = places
    _, model = twin_models("t5")
    parallelize(model, LAYOUTS["t5-flat"][1](*places))
    trace = []
    parts = [on(batch("t5", n=2), A) for _ in range(3)]
    losses = run_chunks(lambda p: model(**p).loss, parts, A, trace)
    assert len(losses) == 3 and all(torch.isfinite(l) for l in losses)
    clocks = {}
    for clock, m, place in trace:
        clocks.setdefault(m, []).append((clock, place))
    for m, segs in clocks.items():  # each micro-batch: encoder on A, decoder on B, head on A; one per clock
        assert [p for _, p in segs] == [A, B, A]
        assert [c for c, _ in segs] == [m, m + 1, m + 2]
    for clock in {c for c, _, _ in trace}:  # within a clock, GPU segments are launched before CPU ones
        kinds = [p.startswith("cuda") for c, _, p in trace if c == clock]
        assert kinds == sorted(kinds, reverse=True)


def test_backward_takes_micro_batches_one_at_a_time_last_first():
    # micro-batches of 3, 2 and 1 rows tell them apart; stacking the losses releases every gradient
    # at once, so only the order edges (not the sum's own chain) keep the micro-batches apart
    ref, model = twin_models("t5")
    parallelize(model, LAYOUTS["t5-flat"][1](*PLACES[0]))
    b = batch("t5")
    parts = [{k: v[i:j] for k, v in b.items()} for i, j in ((0, 3), (3, 5), (5, 6))]
    seen = {"encoder": [], "decoder": []}
    handles = [blk.layer[0].SelfAttention.q.register_full_backward_pre_hook(  # inside each block's backward
        lambda m, g, s=stack: seen[s].append(g[0].shape[0])) for stack in seen for blk in getattr(model, stack).block]
    losses = run_chunks(lambda p: model(**p).loss, parts, "cpu", ordered_backward=True)
    torch.stack(losses).sum().backward()
    assert seen == {"encoder": [1] * 2 + [2] * 2 + [3] * 2, "decoder": [1] * 3 + [2] * 3 + [3] * 3}
    for h in handles:
        h.remove()
    for part in parts:  # the edges carry no values: gradients are those of the plain sum
        ref(**part).loss.backward()
    torch.testing.assert_close(grads(model), grads(ref), **TOL["cpu"])
    model.zero_grad(set_to_none=True)
    for loss in run_chunks(lambda p: model(**p).loss, parts, "cpu"):  # unordered: each backward alone
        loss.backward()
    torch.testing.assert_close(grads(model), grads(ref), **TOL["cpu"])


@pytest.fixture
def cpu1_as_gpu(monkeypatch):
    """`cpu:1` scheduled as if it were a GPU, so that the `cpu` and `cpu:2` segments of a tick run on
    the second thread, beside it, at the same time (schedule.py). Yields the names of the threads
    that ran segments."""
    from bigfit.device_map import schedule

    ran_on, run = [], schedule._run

    def recorded(workers):
        ran_on.append(threading.current_thread().name)
        run(workers)

    monkeypatch.setattr(schedule, "is_cuda", lambda place: place == "cpu:1")
    monkeypatch.setattr(schedule, "_run", recorded)
    yield ran_on


@pytest.mark.parametrize("layout", ["t5-split", "gpt2", "llama"])
def test_host_segments_beside_the_gpus_change_nothing(cpu1_as_gpu, layout):
    family, make = LAYOUTS[layout]
    ref, model = twin_models(family)
    parallelize(model, make(*PLACES[0]))
    b = batch(family)
    expected = ref(**b)
    expected.loss.backward()
    for chunks in (2, 3):
        model.zero_grad(set_to_none=True)
        loss = train_step(model, b, chunks=chunks)
        torch.testing.assert_close(loss, expected.loss.detach(), **TOL["cpu"])
        torch.testing.assert_close(grads(model), grads(ref), **TOL["cpu"])
    assert "bigfit-chunk-host" in cpu1_as_gpu and threading.current_thread().name in cpu1_as_gpu


@pytest.mark.parametrize("beside", [False, True])
def test_chunk_errors_propagate_and_leave_nothing_running(request, beside):
    from bigfit.device_map import pipeline

    if beside:  # the failing micro-batch's host segment runs on the second thread
        request.getfixturevalue("cpu1_as_gpu")
    _, model = twin_models("gpt2")
    parallelize(model, {"cpu": [0], "cpu:1": [1]})

    def fn(p):
        out = model(**p).loss
        if p["input_ids"].shape[0] == 1:
            raise ValueError("chunk failed")
        return out

    with pytest.raises(ValueError, match="chunk failed"):
        run_chunks(fn, [batch("gpt2", 2), batch("gpt2", 1), batch("gpt2", 2)], "cpu")
    assert pipeline.idle()
    threads = threading.active_count()
    assert len(run_chunks(fn, [batch("gpt2", 2)] * 3, "cpu")) == 3  # the pool's threads serve the next run
    assert threading.active_count() == threads
    with pytest.raises(BigfitError, match="chunks must be an integer from 1 to the batch size 6"):
        train_step(model, batch("gpt2"), chunks=7)


# --- bigfit train --strategy device_map, bigfit plan ---------------------------------------------------

COMMON = ["--max-steps", "3", "--batch-size", "4", "--eval-every", "0", "--eval-samples", "4", "--num-beams", "2",
          "--max-new-tokens", "4", "--no-consolidate", "--seed", "3"]


def test_train_command_device_map_with_chunks_matches_single(tmp_path):
    import json

    from bigfit.cli import main
    from conftest import read_jsonl

    spec = {"encoder": {"cpu": [0], "cpu:1": [1, 2]}, "decoder": {"cpu:2": [0, 1]}}  # the embedded 3 + 2 block T5
    (tmp_path / "map.json").write_text(json.dumps(spec))
    assert main(["train", "--strategy", "single", "--output-dir", str(tmp_path / "single"), *COMMON]) == 0
    assert main(["train", "--strategy", "device_map", "--device-map", str(tmp_path / "map.json"), "--chunks", "2",
                 "--output-dir", str(tmp_path / "dm"), *COMMON]) == 0
    single, split = read_jsonl(tmp_path / "single/metrics.jsonl"), read_jsonl(tmp_path / "dm/metrics.jsonl")
    assert [r["step"] for r in split] == [1, 2, 3]
    for a, b in zip(single, split):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    ea, eb = read_jsonl(tmp_path / "single/eval.jsonl")[-1], read_jsonl(tmp_path / "dm/eval.jsonl")[-1]
    assert eb["eval_loss"] == pytest.approx(ea["eval_loss"], rel=1e-5)
    assert (tmp_path / "dm/checkpoints/step-00000003/COMPLETE").is_file()


@pytest.mark.parametrize("argv,message", [
    (["--strategy", "device_map", "--nproc", "2"], "strategy 'device_map' runs one process"),
    (["--strategy", "zero3", "--chunks", "2"], "--chunks belongs to --strategy device_map or a pipeline (--pp)"),
    (["--strategy", "device_map", "--chunks", "5", "--batch-size", "4"], "--chunks 5 splits each micro-batch of 4"),
    (["--strategy", "device_map", "--device-map", "{d}/bad.json"], "the map of stack 'decoder' misses block(s) 1"),
    (["--strategy", "device_map", "--device-map", "{d}/none.json"], "none.json' is not a file"),
])
def test_train_command_bad_device_map_input(tmp_path, capsys, argv, message):
    import json

    from bigfit.cli import main

    (tmp_path / "bad.json").write_text(json.dumps({"encoder": {"cpu": [0, 1, 2]}, "decoder": {"cpu:1": [0]}}))
    out = tmp_path / "out"
    assert main(["train", *[a.format(d=tmp_path) for a in argv], "--output-dir", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # before any work


def test_plan_shows_the_auto_device_map():
    from bigfit.machine.hardware import Hardware
    from bigfit.planning.report import device_map_text
    from bigfit.planning.search import plan_for_config

    def _device_map(config, hw, job):
        return plan_for_config(config, hw, job).device_map

    hw = Hardware(gpu_bytes=(8 * 10**9, 24 * 10**9), cpu_ram=64 * 10**9)
    shown = _device_map(tiny_config("t5"), hw, Workload(batch_size=4, seq_len=16, target_len=8))
    assert shown["map"] == {"main_device": "cuda:0", "encoder": {"cuda:0": [0, 1]}, "decoder": {"cuda:0": [0, 1, 2]}}
    assert "encoder 0-1 -> cuda:0; decoder 0-2 -> cuda:0" in device_map_text(shown)
    tiny_gpus = Hardware(gpu_bytes=(2**30 + 500_000, 2**30 + 10**6), cpu_ram=10**9)  # 0.5 MB and 1 MB left
    shown = _device_map(tiny_config("t5"), tiny_gpus, Workload(batch_size=4, seq_len=16, target_len=8))
    assert set(shown["devices"]) == {"cuda:0", "cuda:1", "cpu"}  # spread over both GPUs, the rest in host RAM
    shown = _device_map(tiny_config("t5"), Hardware(gpu_bytes=(2**30,), cpu_ram=10**5), Workload(batch_size=4, seq_len=16))
    assert shown["map"] is None and "does not fit" in device_map_text(shown)


def test_activation_checkpointing_inside_placed_blocks():
    from bigfit.engine.checkpointing import apply_activation_checkpointing, remove_activation_checkpointing

    ref, model = twin_models("t5")
    parallelize(model, LAYOUTS["t5-split"][1](*PLACES[0]))  # split first, then checkpointing (the documented order)
    assert apply_activation_checkpointing(model) == 5
    b = {**batch("t5"), "use_cache": False}  # as bigfit trains: a cache filled in forward breaks the recompute
    loss = train_step(model, b, chunks=2)
    expected = ref(**b)
    expected.loss.backward()
    torch.testing.assert_close(loss, expected.loss.detach(), **TOL["cpu"])
    torch.testing.assert_close(grads(model), grads(ref), **TOL["cpu"])
    remove_activation_checkpointing(model)
    deparallelize(model)
