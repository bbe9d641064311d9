"""Evaluation: held-out loss for every model; for encoder-decoders also generate() with beam search,
scored with BLEU (sacrebleu's corpus BLEU, 0-100) and exact match (share of outputs equal to the
reference after whitespace normalisation).

Every rank runs the same number of forward passes (sharded strategies gather parameters inside each
forward, a collective): a rank whose share of the last batch is empty repeats a sample and drops its
result, and generate() runs with synced_gpus so that ranks whose beams finish early keep stepping.
Pipeline stages evaluate the held-out loss through their schedule; generate() would need every stage
in one process, so under `--strategy pipeline` there is no BLEU: generate with the consolidated model.
"""
from __future__ import annotations

import warnings

import torch

from ..common.distributed import Runtime, all_reduce_sum, gather_objects
from ..data import collate
from ..engine import Engine
from .metrics import EvalProgress


def shard_batches(items: list, rt: Runtime, batch_size: int) -> list[tuple[list, int]]:
    """This rank's evaluation batches as (items, n_real): equal batch counts on every rank."""
    out, span = [], batch_size * rt.world_size
    for start in range(0, len(items), span):
        chunk = items[start:start + span]
        mine = chunk[rt.rank * batch_size:(rt.rank + 1) * batch_size]
        out.append((mine or chunk[:1], len(mine)))
    return out


@torch.no_grad()
def evaluate(applied: Engine, samples: list[dict], *, tokenizer, pad_id: int, seq2seq: bool, rt: Runtime,
             batch_size: int, num_beams: int, max_new_tokens: int) -> dict:
    if not samples:
        return {}
    model = applied.model
    was_training = model.training
    model.eval()
    loss, tokens, pairs = 0.0, 0, []
    generate = seq2seq and applied.generates
    span = batch_size * rt.data.world_size  # the samples a batch takes over all data ranks
    progress = EvalProgress(len(samples)) if rt.is_main else None  # the rank that speaks
    try:
        for i, (items, n_real) in enumerate(shard_batches(samples, rt.data, batch_size)):
            batch = collate(items, pad_id, rt.device, multiple=applied.sequence_multiple)
            l, n = applied.eval_batch(batch, seq2seq)
            if n_real and applied.counts:
                loss, tokens = loss + l, tokens + n
            if generate:
                texts = _generate(applied, batch, tokenizer, num_beams, max_new_tokens, rt)
                pairs += [(t, s["target"]) for t, s in zip(texts[:n_real], items[:n_real]) if applied.counts]
            if progress:
                progress.update(min(len(samples), (i + 1) * span))  # equal batch counts: this rank speaks for all
    finally:
        if progress:
            progress.close()
        model.train(was_training)
        applied.reshard()
    loss, tokens = all_reduce_sum([loss, tokens], rt)
    out = {"eval_loss": loss / max(tokens, 1.0)}
    out["eval_ppl"] = float(torch.tensor(out["eval_loss"]).exp())
    if generate:
        gathered = gather_objects(pairs, rt)
        if rt.is_main:
            out.update(score([p for part in gathered for p in part]))
    return out


def _generate(applied: Engine, batch: dict, tokenizer, num_beams: int, max_new_tokens: int, rt: Runtime) -> list[str]:
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    # A cache that grows one layer at a time: transformers sizes the default one by the encoder's
    # depth, which breaks models whose decoder is deeper (unequal T5 stacks).
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with applied.generation_context(), applied.forward_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # newer transformers call past_key_values `cache`
        out = applied.module.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_beams=num_beams,
            max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, past_key_values=cache,
            synced_gpus=rt.distributed)
    return tokenizer.batch_decode(decodable(out, len(tokenizer)), skip_special_tokens=True)


def decodable(ids: torch.Tensor, vocab: int) -> list[list[int]]:
    """Generated ids without those the tokenizer has no token for: a model's vocabulary may be
    larger than its tokenizer's (t5's 32128 rows for 32100 tokens; a config-only model's over the
    byte-level tokenizer's 384), and tokenizers fail on such ids (ByT5's raises)."""
    return [[t for t in row if t < vocab] for row in ids.tolist()]


def score(pairs: list[tuple[str, str]]) -> dict:
    import sacrebleu

    if not pairs:
        return {}
    hyps = [" ".join(h.split()) for h, _ in pairs]
    refs = [" ".join(r.split()) for _, r in pairs]
    bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
    exact = sum(h == r for h, r in zip(hyps, refs)) / len(pairs)
    return {"eval_bleu": bleu, "eval_exact_match": exact, "eval_example": {"output": hyps[0], "reference": refs[0]}}
