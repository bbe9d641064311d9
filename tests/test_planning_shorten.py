"""The planning trace runs three blocks of each stack whose later blocks are alike (planning/shorten.py):
its profile must equal the whole model's trace, field for field, for every family, device, precision
and LoRA, and a stack whose blocks differ is traced whole. Micro-batches above 3 are drawn from the
traces at 2 and 3 (profile._affine): equal to their own trace, field for field, too."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
from transformers import GPT2Config, LlamaConfig, T5Config

from bigfit.adapters.lora import LoraSettings
from bigfit.planning import shorten
from bigfit.planning import profile
from bigfit.planning.profile import _profile


def deep(family: str):
    if family == "t5":  # unequal depth, gated FFN, dropout on: the position bias lives in block 0
        return T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=6, num_decoder_layers=5,
                        num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    if family == "gpt2":
        return GPT2Config(vocab_size=384, n_embd=32, n_layer=6, n_head=2, n_positions=64)
    return LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _whole(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(shorten, "KEEP", 10**6)
        return _profile(*args, **kwargs)


CASES = [("cpu", False, "fp32", None), ("cuda", True, "bf16", None), ("cuda", False, "bf16", None),
         ("cuda", True, "bf16", LoraSettings(r=4))]


@pytest.mark.parametrize("family", ["t5", "gpt2", "llama"])
@pytest.mark.parametrize("device,autocast,precision,lora", CASES)
def test_the_short_trace_equals_the_whole_one(monkeypatch, family, device, autocast, precision, lora):
    config = deep(family)
    short = _profile(config, 2, 16, 8, precision, device, autocast, lora)
    whole = _whole(monkeypatch, config, 2, 16, 8, precision, device, autocast, lora)
    assert short.n_blocks == whole.n_blocks >= 6
    for f in dataclasses.fields(whole):
        assert getattr(short, f.name) == getattr(whole, f.name), f.name


@pytest.mark.parametrize("family", ["t5", "gpt2", "llama"])
@pytest.mark.parametrize("device,autocast,precision,lora", CASES)
def test_a_large_micro_batch_drawn_from_two_small_ones_equals_its_trace(monkeypatch, family, device, autocast,
                                                                        precision, lora):
    config, args = deep(family), (16, 8, precision, device, autocast, lora)
    monkeypatch.setattr(profile, "_traced", OrderedDict())
    drawn = profile.profile_model(config, 11, *args)
    assert len(profile._traced) == 3  # 2, 3 and 11 drawn from them: 11 was not traced
    traced = _profile(config, 11, *args)
    for f in dataclasses.fields(traced):
        assert getattr(drawn, f.name) == getattr(traced, f.name), f.name


def test_a_stack_whose_blocks_differ_is_traced_whole():
    from transformers import AutoModelForCausalLM

    from bigfit.models.source import block_lists
    model = AutoModelForCausalLM.from_config(deep("llama"))
    for i, layer in enumerate(model.model.layers):  # a per-block setting that is not its number
        layer.attention_type = "sliding" if i % 2 else "full"
    assert shorten.kept(block_lists(model)) == [6]
    model = AutoModelForCausalLM.from_config(deep("llama"))
    assert shorten.kept(block_lists(model)) == [3]


def test_the_trace_cache_lets_the_least_recently_used_go(monkeypatch):
    config, args = deep("gpt2"), (16, 8, "bf16", "cuda", True, None)
    traced = []
    monkeypatch.setattr(profile, "_traced", OrderedDict())
    monkeypatch.setattr(profile, "_TRACED_KEPT", 2)
    monkeypatch.setattr(profile, "_profile", lambda _config, m, *_: traced.append(m) or m)
    for m in (1, 2, 1, 3, 1, 2):  # 2 goes when 3 comes (1 was asked since); 3 goes when 2 comes back
        profile.profile_model(config, m, *args)
    assert traced == [1, 2, 3, 2] and list(profile._traced) == [(config.to_json_string(), m, *args) for m in (1, 2)]
