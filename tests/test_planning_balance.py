"""Device maps before anything moves (bigfit.device_map): map forms and the errors that name a bad
map, the pure balancer (fewest devices, budgets, the host as overflow, the encoder/decoder boundary),
and the auto map built from the planner's bytes. Hooks, equality and chunks: tests/test_device_map.py."""
from __future__ import annotations

import pytest
import torch

from bigfit.device_map import deparallelize, layout_of, parallelize
from bigfit.errors import BigfitError
from bigfit.planning.automap import plan_map, parse_budgets
from bigfit.planning.balance import balance
from bigfit.planning.search import Workload
from tiny import tiny_config, twin_models

# --- maps and their errors, before anything moves ---------------------------------------------------

BAD_MAPS = [
    ({"encoder": {"cpu": [0]}, "decoder": {"cpu": [0, 1, 2]}}, "misses block(s) 1"),
    ({"encoder": {"cpu": [0, 1], "cpu:1": [1]}, "decoder": {"cpu": [0, 1, 2]}}, "block 1 of stack 'encoder' is mapped twice"),
    ({"encoder": {"cpu": [0, 1, 2]}, "decoder": {"cpu": [0, 1, 2]}}, "names block 2"),
    ({"encoder": {"cpu": [0, 1]}, "decodr": {"cpu": [0, 1, 2]}}, "stack 'decodr'"),
    ({"encoder": {"cpu": [0, 1]}}, "places no block of stack 'decoder'"),
    ({"cpu": [0, 1]}, "give one map per stack"),
    ({"encoder": {"gpu0": [0, 1]}, "decoder": {"cpu": [0, 1, 2]}}, "'gpu0' is not a device"),
    ({"encoder": {f"cuda:{torch.cuda.device_count()}": [0, 1]}, "decoder": {"cpu": [0, 1, 2]}}, "does not exist"),
    ({"encoder": {"cpu": [0, 1]}, "decoder": {"cpu": [0, 1, 2]}, "lm_hed": "cpu:1"}, "module 'lm_hed'"),
    ({"encoder": {"cpu": [0, 1]}, "decoder": {"cpu": [0, 1, 2]}, "decoder.block.1.layer": "cpu:1"}, "part of) a block"),
    ({"encoder": {"cpu": [0, 1]}, "decoder": {"cpu": [0, 1, 2]}, "lm_head": "cpu:1"}, "tied to shared.weight"),
]


@pytest.mark.parametrize("spec,message", BAD_MAPS, ids=[m for _, m in BAD_MAPS])
def test_bad_map_is_an_error_naming_it_and_nothing_moves(spec, message):
    _, model = twin_models("t5")
    before = {n: (p.device, p.data_ptr()) for n, p in model.named_parameters()}
    with pytest.raises(BigfitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallelize(model, spec)
    assert layout_of(model) is None
    assert {n: (p.device, p.data_ptr()) for n, p in model.named_parameters()} == before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_map_forms_and_describe():
    _, model = twin_models("gpt2")
    dmap = parallelize(model, {"cpu:1": [1], "cpu": [0]})  # one stack: its map alone
    assert dmap.blocks == {"transformer": ("cpu", "cpu:1")} and dmap.main_device == "cpu"
    assert dmap.describe() == "transformer 0 -> cpu, 1 -> cpu:1; other modules on cpu"
    assert dmap.hops() == 2
    deparallelize(model)
    with pytest.raises(BigfitError, match="not parallelized"):
        deparallelize(model)
    dmap2 = parallelize(model, dmap.to_json())  # the JSON form reads back to the same map
    assert dmap2 == dmap
    with pytest.raises(BigfitError, match="already parallelized"):
        parallelize(model, dmap.to_json())
    deparallelize(model)


# --- the balancer (pure) ----------------------------------------------------------------------------

def test_balance_fewest_devices_then_by_budget():
    assert balance([1] * 8, [("a", 8), ("b", 8)]) == ["a"] * 8  # fits on the first: no device change
    assert balance([1] * 16, [("a", 8), ("b", 24)]) == ["a"] * 4 + ["b"] * 12  # larger device, more blocks
    assert balance([1] * 8, [("a", 6), ("b", 6)]) == ["a"] * 4 + ["b"] * 4
    # the main device's own bytes (embeddings, head) count against its budget
    assert balance([1] * 8, [("a", 6), ("b", 6)], main_bytes=2) == ["a"] * 3 + ["b"] * 5


def test_balance_host_is_overflow_and_boundary_is_preferred():
    cpu_last = [("cuda:0", 4), ("cuda:1", 3), ("cpu", 100)]
    assert balance([1] * 8, cpu_last, main_bytes=2) == ["cuda:0"] * 2 + ["cuda:1"] * 3 + ["cpu"] * 3
    enc_dec = [2] * 4 + [3] * 4  # decoder blocks are larger (cross-attention)
    assert balance(enc_dec, [("a", 12), ("b", 12)]) == ["a"] * 5 + ["b"] * 3  # balanced: 10 and 9
    assert balance(enc_dec, [("a", 12), ("b", 12)], boundaries=[4]) == ["a"] * 4 + ["b"] * 4  # 8 and 12: taken
    assert balance(enc_dec, [("a", 8), ("b", 24)], boundaries=[4]) == ["a"] * 2 + ["b"] * 6  # too unbalanced


def test_balance_errors():
    with pytest.raises(BigfitError, match=r"does not fit the budgets: it needs about 10 B .* give 4 B"):
        balance([1] * 8, [("a", 2), ("b", 2)], main_bytes=2)
    with pytest.raises(BigfitError, match="main device c has no budget"):
        balance([1], [("a", 2)], main="c")
    with pytest.raises(BigfitError, match="budget of cpu .7XB. is not a size"):
        parse_budgets({"cpu": "7XB"})


def test_auto_map_from_the_planner_fits_its_budgets():
    job = Workload(batch_size=4, seq_len=16, target_len=8)
    shown = plan_map(tiny_config("t5"), parse_budgets({"cpu": "1MB", "cpu:1": "1MB"}), job)
    assert shown["map"] == {"main_device": "cpu", "encoder": {"cpu": [0, 1]}, "decoder": {"cpu:1": [0, 1, 2]}}
    assert all(d["predicted_bytes"] <= d["budget_bytes"] for d in shown["devices"].values())
    _, model = twin_models("t5")
    dmap = parallelize(model, "auto", budgets={"cpu": "1MB", "cpu:1": "1MB"}, job=job)
    assert dmap.to_json() == shown["map"]  # parallelize("auto") takes the map the plan shows
    deparallelize(model)
    with pytest.raises(BigfitError, match="does not fit"):
        parallelize(model, "auto", budgets={"cpu": "300KB", "cpu:1": "300KB"}, job=job)
