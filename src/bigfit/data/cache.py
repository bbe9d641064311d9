"""A node's tokenized training data, built once and memory-mapped by every rank (`--data-cache`).

The first process of a node to take an entry's lock (bigfit's launcher, before its workers start; under
torchrun one of the ranks) reads --data, tokenizes it in `--dataset-num-proc` processes (datasets' map,
calling tokenize.py's own per-example functions), then cuts running text into blocks, holds out the
evaluation samples and packs with numpy on the Arrow arrays, and writes an Arrow file; the others wait
on the lock, then map the file. So no rank holds the corpus as Python objects, and the kernel keeps one
copy of its pages per node. The samples are those of tokenize.build_dataset, element for element
(tests/test_data_cache.py).

An entry is named by a digest of all that decides its samples: the data's content (a file's sha256, a
dataset's fingerprint), the tokenizer, the lengths, packing, the hold-out and the column mapping. bigfit
never deletes entries (each says its size when built): remove the directory to reclaim the space.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

from ..errors import BigfitError
from .arrays import ArrowSamples, blocks, drop_rows, lists_of, pack_columns, write
from .digest import examples_digest, file_sha256
from .files import iter_examples
from .tables import is_table, looks_like_hub_name, read_table
from .tokenize import Dataset, check_enough, held_out, ids_of, kind_of, pad_id, sample_of, sample_unit

VERSION = 1  # of the samples' layout: a change here makes new entries
AUTO_BYTES = 64 * 2**20  # --data-cache auto: data this large and larger goes through the cache


def wanted(cfg) -> bool:
    """Whether --data goes through the cache: `on` or a directory, or `auto` and 64 MB or more of
    files (a hub dataset: always). Needs the `datasets` extra; `auto` without it stays in memory."""
    if not cfg.data or cfg.data_cache == "off":
        return False
    if cfg.data_cache != "auto":
        if not _has_datasets():
            raise BigfitError(f"--data-cache {cfg.data_cache} needs the datasets library: pip install 'bigfit[data]' "
                              "(or --data-cache off)")
        return True
    if not _has_datasets():
        return False
    path = Path(cfg.data).expanduser()
    if not path.exists():  # a hub name (tables.py), or a missing file: read_examples' line says so
        return looks_like_hub_name(cfg.data)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) >= AUTO_BYTES


def root(cfg) -> Path:
    if cfg.data_cache not in ("auto", "on"):
        return Path(cfg.data_cache).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bigfit" / "tokenized"


def tokenized(cfg, tok, seq2seq: bool) -> tuple[Dataset, str, dict]:
    """(the dataset, the data's digest for the run's identity, the entry's metadata and "dir")."""
    where = root(cfg)
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BigfitError(f"--data-cache {str(where)!r} cannot be created ({e.strerror}); name a writable directory "
                          "with --data-cache DIR, or --data-cache off") from None
    source = _source(cfg)
    key = _key(cfg, tok, seq2seq, source)
    entry = where / key
    with open(where / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel however its holder ends
        if not (entry / "meta.json").exists():
            tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
            try:
                _build(cfg, tok, seq2seq, entry, tmp)
            finally:  # a mistake in the data, or an interrupt: nothing half-built is left behind
                shutil.rmtree(tmp, ignore_errors=True)
            built = json.loads((entry / "meta.json").read_text())
            print(f"tokenized {cfg.data} into {entry}: {built['train']} training samples, {built['bytes'] / 1e9:.2f} GB "
                  f"in {built['built_s']} s", flush=True)
    meta = {**json.loads((entry / "meta.json").read_text()), "dir": str(entry)}
    check_enough(meta["train"], len(meta["eval"]), cfg.batch_size, cfg.max_source_len, cfg.pack)
    dataset = Dataset(train=ArrowSamples(entry / "train.arrow"), eval=meta["eval"], pad_id=pad_id(tok),
                      packed=meta["packed"], cached=str(entry))
    return dataset, source.get("sha256") or meta["examples_sha256"], meta


def _source(cfg) -> dict:
    """What identifies --data without decoding its rows: a file's sha256, a dataset's fingerprint."""
    path = Path(cfg.data).expanduser()
    if path.is_file() and not is_table(cfg.data):
        return {"sha256": file_sha256(path)}
    table = read_table(cfg.data, cfg.data_split, cfg.data_config)
    return {"fingerprint": table._fingerprint, "rows": len(table), "path": str(path.resolve()) if path.exists() else cfg.data}


def _key(cfg, tok, seq2seq: bool, source: dict) -> str:
    vocab = tok.backend_tokenizer.to_str() if tok.is_fast else json.dumps(sorted(tok.get_vocab().items()))
    parts = dict(version=VERSION, source=source, seq2seq=seq2seq, tokenizer=[type(tok).__name__, vocab,
                 tok.eos_token_id, tok.bos_token_id, getattr(tok, "chat_template", None)],
                 **{k: getattr(cfg, k) for k in ("max_source_len", "max_target_len", "pack", "eval_samples", "seed",
                                                 "data_columns", "data_split", "data_config", "data_encoding")})
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _build(cfg, tok, seq2seq: bool, entry: Path, tmp: Path) -> None:
    """The entry, built in `tmp` and renamed into place whole."""
    t0 = time.perf_counter()
    shutil.rmtree(tmp, ignore_errors=True)
    raw = _examples(cfg, tmp)
    kind = kind_of([raw[0]], seq2seq)
    if kind == "messages":
        from .chat import require_template

        require_template(tok, cfg.model)
    digest = examples_digest(cfg.data, iter_examples(*_reading(cfg)))  # a file's: read by nobody here
    out = _tokenize(cfg, tok, kind, seq2seq, raw, tmp)
    columns, evals, packed = _samples(cfg, out, kind)
    rows = write(tmp / "train.arrow", columns)
    del raw, out, columns
    for part in ("examples", "tokens"):
        shutil.rmtree(tmp / part)
    meta = {"train": rows, "eval": evals, "packed": packed, "kind": kind, "examples_sha256": digest, "built_by": os.getpid(),
            "bytes": (tmp / "train.arrow").stat().st_size, "built_s": round(time.perf_counter() - t0, 1)}
    (tmp / "meta.json").write_text(json.dumps(meta))
    os.replace(tmp, entry)  # whole, or not there: a waiting rank never maps half an entry


def _reading(cfg) -> tuple:
    return cfg.data, cfg.data_encoding, cfg.data_columns, cfg.data_split, cfg.data_config


def _examples(cfg, tmp: Path):
    """--data's examples, read one at a time (files.iter_examples, each checked as it is read) into an
    Arrow file under `tmp`: no list of them is held, and the tokenizing processes map their shards from
    the file instead of receiving a pickled copy. A mistake in the data is its one line."""
    import datasets

    try:
        return datasets.Dataset.from_generator(iter_examples, gen_kwargs=dict(zip(
            ("path", "encoding", "columns", "split", "config"), _reading(cfg))), cache_dir=str(tmp / "examples"))
    except datasets.exceptions.DatasetGenerationError as e:
        if isinstance(e.__cause__, BigfitError):
            raise e.__cause__ from None
        raise


def _tokenize(cfg, tok, kind: str, seq2seq: bool, raw, tmp: Path):
    """The examples' samples (text: each document's ids) as a datasets.Dataset in files under `tmp`."""
    import datasets

    (tmp / "tokens").mkdir()
    ids = datasets.Sequence(datasets.Value("int32"))  # half of what Python ints would be stored as
    columns = {"input_ids": ids} if kind == "text" else {"input_ids": ids, "labels": ids}
    if kind == "pairs":
        columns.update(source=datasets.Value("string"), target=datasets.Value("string"))
        if not seq2seq:
            columns["prompt_len"] = datasets.Value("int32")
    return raw.map(_Tokenize(tok, kind, seq2seq, cfg.max_source_len, cfg.max_target_len), batched=True,
                   num_proc=_procs(cfg, len(raw)), remove_columns=raw.column_names, features=datasets.Features(columns),
                   cache_file_name=str(tmp / "tokens" / "tokens.arrow"), desc=f"tokenizing {cfg.data} into the cache")


def _samples(cfg, out, kind: str) -> tuple[dict, list[dict], int]:
    """(the training columns, the evaluation samples, how many samples were packed): build_dataset's
    blocks, hold-out and packing, on flat arrays."""
    ids = lists_of(out.data.column("input_ids"))
    labels = None if kind == "text" else lists_of(out.data.column("labels"))
    if kind == "text":
        ids = blocks(ids, cfg.max_source_len, per_document=cfg.pack)
    eval_idx = held_out(len(ids.lengths), cfg.eval_samples, cfg.seed, sample_unit(kind, cfg.max_source_len))
    evals = [{"input_ids": ids.row(i), "labels": ids.row(i)} if kind == "text" else out[int(i)] for i in eval_idx]
    ids = drop_rows(ids, eval_idx)
    labels = ids if labels is None else drop_rows(labels, eval_idx)
    if not cfg.pack:
        return {"input_ids": ids, "labels": labels}, evals, 0
    return pack_columns(ids, labels, cfg.max_source_len), evals, len(ids.lengths)


def _procs(cfg, rows: int) -> int | None:
    procs = cfg.dataset_num_proc or os.cpu_count() or 1
    return procs if procs > 1 and rows >= 1000 * procs else None  # below that, starting processes costs more


class _Tokenize:
    """datasets.map's batched function: tokenize.py's per-example samples (text: each document's ids)."""

    def __init__(self, tok, kind: str, seq2seq: bool, max_source_len: int, max_target_len: int):
        self.tok, self.kind, self.seq2seq, self.lens = tok, kind, seq2seq, (max_source_len, max_target_len)

    def __call__(self, batch: dict) -> dict:
        if self.kind == "text":
            return {"input_ids": [ids_of(self.tok, t) for t in batch["text"]]}
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        samples = [sample_of(self.tok, ex, self.kind, self.seq2seq, *self.lens) for ex in rows]
        return {k: [s[k] for s in samples] for k in samples[0]}


def _has_datasets() -> bool:
    return importlib.util.find_spec("datasets") is not None  # the cache's library, in the `bigfit[data]` extra
