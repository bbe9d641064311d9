"""Turning examples into token samples, and holding out the evaluation split.

A sample is a dict of `input_ids` and `labels` (token id lists; -100 marks positions without loss)
plus, for source/target pairs, the raw strings that evaluation compares generations with.
Encoder-decoder: input = source, labels = target. Decoder-only: input = source + target with the
source masked out of the loss, a block of `max_source_len` tokens of running text, or a conversation
with the loss on its assistant turns (chat.py). `pack` (decoder-only): the training samples laid end to
end into sequences of `max_source_len` tokens (pack.py); running text is then cut per document, so that
no sample spans two.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import BigfitError
from ..settings.config import TrainConfig
from .chat import chat_sample
from .pack import pack as pack_samples

IGNORE = -100


@dataclass
class Dataset:
    train: Sequence[dict]  # a list, or cache.py's memory-mapped ArrowSamples
    eval: list[dict]
    pad_id: int
    packed: int = 0  # --pack: the samples laid end to end into `train`'s sequences; 0: not packed
    cached: str | None = None  # the cache entry `train` is mapped from (cache.py); None: in memory


def ids_of(tok, text: str) -> list[int]:
    ids = tok(text, add_special_tokens=True)["input_ids"]
    if tok.eos_token_id is not None and (not ids or ids[-1] != tok.eos_token_id):
        ids = ids + [tok.eos_token_id]  # GPT-2-style tokenizers add no end marker themselves
    return ids


def _pair_sample(tok, ex: dict, seq2seq: bool, max_src: int, max_tgt: int) -> dict:
    src, tgt = ids_of(tok, ex["source"])[:max_src], ids_of(tok, ex["target"])[:max_tgt]
    if seq2seq:
        return {"input_ids": src, "labels": tgt, "source": ex["source"], "target": ex["target"]}
    if tok.eos_token_id is not None and src and src[-1] == tok.eos_token_id:
        src = src[:-1]  # the prompt runs straight into its answer
    return {"input_ids": src + tgt, "labels": [IGNORE] * len(src) + tgt,
            "source": ex["source"], "target": ex["target"], "prompt_len": len(src)}


def _text_blocks(tok, examples: list[dict], block: int, per_document: bool) -> list[dict]:
    """Blocks of `block` tokens of the documents run together (the last partial block dropped), or
    `per_document`: each document's blocks, its last one shorter, for packing to fill."""
    streams: list[list[int]] = [[]]
    for ex in examples:
        if per_document:
            streams.append([])
        streams[-1] += ids_of(tok, ex["text"])
    full = 0 if per_document else block - 1  # a partial block: kept per document only
    blocks = [s[i:i + block] for s in streams for i in range(0, max(len(s) - full, 0), block)]
    return [{"input_ids": b, "labels": list(b)} for b in blocks]


def kind_of(examples: list[dict], seq2seq: bool) -> str:
    """"pairs", "text" or "messages": what the examples are, checked against the model."""
    kind = "text" if "text" in examples[0] else "messages" if "messages" in examples[0] else "pairs"
    if kind != "pairs" and seq2seq:
        raise BigfitError(f"this model is an encoder-decoder and needs source/target data, but --data holds "
                          f"{kind!r} records; give JSONL/CSV with source and target, or a decoder-only model")
    return kind


def sample_of(tok, ex: dict, kind: str, seq2seq: bool, max_source_len: int, max_target_len: int) -> dict:
    """One pair's or conversation's sample (text is cut into blocks after tokenizing: _text_blocks)."""
    if kind == "messages":  # the template was checked (chat.require_template) where the tokenizer was loaded
        return chat_sample(tok, ex["messages"], max_source_len)
    return _pair_sample(tok, ex, seq2seq, max_source_len, max_target_len)


def held_out(n: int, eval_samples: int, seed: int, unit: str = "samples") -> list[int]:
    """The indices of the evaluation samples among `n`, in their evaluation order (the same on every rank):
    at most a tenth of the data, so that training keeps nine tenths. A larger --eval-samples is refused
    here, where the data's size is first known (before any process trains); the default takes a tenth of
    data too small for it, as the start-of-run table says. `unit`: what a sample is, for the error."""
    most = n // 10
    if eval_samples > most and eval_samples != TrainConfig.eval_samples:
        fewer = f"--eval-samples {most} or fewer" if most else "--eval-samples 0"
        raise BigfitError(f"--eval-samples {eval_samples}: the data gives {n} {unit}, of which at most a tenth ({most}) "
                          f"is held out for evaluation; give {fewer} (0: no evaluation), or more data")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order[:min(eval_samples, most)]


def sample_unit(kind: str, max_source_len: int) -> str:
    """What one sample of `kind` is, as held_out's error says it."""
    return f"blocks of {max_source_len} tokens" if kind == "text" else "samples"


def check_enough(n_train: int, n_eval: int, min_train: int, max_source_len: int, pack: bool) -> None:
    if n_train < min_train:
        unit = f"sequences of {max_source_len} tokens packed" if pack else f"blocks of {max_source_len} tokens for text"
        raise BigfitError(f"--data gives {n_train} training samples after holding out {n_eval} for evaluation "
                          f"({unit}); one global batch needs {min_train}: give more data or a smaller --batch-size")


def pad_id(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def build_dataset(examples: list[dict], tok, seq2seq: bool, *, max_source_len: int, max_target_len: int,
                  eval_samples: int, seed: int, min_train: int, pack: bool = False) -> Dataset:
    """Tokenize, then hold out `eval_samples` samples chosen by `seed` (the same on every rank); `pack`:
    pack the rest (the held-out ones stay single: generation evaluates them one by one). In memory:
    cache.py makes the same samples into memory-mapped files for data too large for that."""
    kind = kind_of(examples, seq2seq)
    if kind == "text":
        samples = _text_blocks(tok, examples, max_source_len, per_document=pack)
    else:
        samples = [sample_of(tok, ex, kind, seq2seq, max_source_len, max_target_len) for ex in examples]
    eval_idx = held_out(len(samples), eval_samples, seed, sample_unit(kind, max_source_len))
    held = set(eval_idx)
    train = [s for i, s in enumerate(samples) if i not in held]
    packed = len(train) if pack else 0
    if pack:  # no part's first token is predicted from the part before it
        train = pack_samples([{**s, "labels": [IGNORE, *s["labels"][1:]]} for s in train], max_source_len)
    check_enough(len(train), len(eval_idx), min_train, max_source_len, pack)
    return Dataset(train=train, eval=[samples[i] for i in eval_idx], pad_id=pad_id(tok), packed=packed)
