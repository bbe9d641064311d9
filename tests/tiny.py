"""Tiny models of the three families that break naive parallelism, and small data, built in the test."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import GPT2Config, LlamaConfig, T5Config

from bigfit.data import digits_task

FAMILIES = ("t5", "gpt2", "llama")


def tiny_config(family: str):
    if family == "t5":  # unequal depth, tied embeddings
        return T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3,
                        num_heads=4, dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0,
                        pad_token_id=0, eos_token_id=1)
    if family == "gpt2":  # Conv1D layers, tied wte/lm_head
        return GPT2Config(vocab_size=384, n_embd=32, n_layer=2, n_head=2, n_positions=256, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if family == "llama":  # RoPE, grouped-query attention, untied head
        return LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    raise ValueError(family)


def twin_models(family: str):
    """(reference, copy to split or shard): the same random weights, dropout off in the tiny configs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    auto = AutoModelForSeq2SeqLM if family == "t5" else AutoModelForCausalLM
    ref = auto.from_config(tiny_config(family))
    return ref, copy.deepcopy(ref)


def write_model_dirs(root: Path) -> dict[str, Path]:
    out = {}
    for family in FAMILIES:
        tiny_config(family).save_pretrained(root / family)
        out[family] = root / family
    return out


def write_pairs(path: Path, n: int, seed: int = 7) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in digits_task(n, seed)))
    return path


class Stack(torch.nn.Module):
    """Five offload buckets (four tanh blocks and a 3-wide head): more than the offload engine's
    three gradient slots. `width` 5 splits rows unevenly over two ranks (3 and 2)."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)
