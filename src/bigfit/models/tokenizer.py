"""The model's tokenizer: its own, or the byte-level one where it has none.

A tokenizer is saved with every checkpoint and with the trained model, so a stand-in is never
chosen silently: tokenizer files that exist must load (one line naming the file when they do not),
and the byte-level tokenizer (ByT5's, which needs no files) is used only for the embedded default
and for a model directory with no tokenizer file at all, which the start-of-run table says.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, ByT5Tokenizer

from ..errors import BigfitError
from .source import ModelSource

# Any of these in a model directory means it brings its own tokenizer (transformers' tokenizer
# classes read their vocabularies from the last five; the JSON ones must parse).
JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_FILES = (*JSON_FILES, "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "tokenizer.model")


def tokenizer_files(src: ModelSource) -> list[str]:
    """The tokenizer files a local --model directory holds ([] for the default and a hub name)."""
    if src.kind not in ("config", "weights"):
        return []
    return [f for f in TOKENIZER_FILES if (Path(src.name).expanduser() / f).exists()]


def load_tokenizer(src: ModelSource, config):
    """A hub name's tokenizer, a model directory's when it holds any tokenizer file, else the
    byte-level one; a BigfitError naming the file for tokenizer files that do not load."""
    if src.kind == "hub":
        return _own(src.name, f"the tokenizer of --model {src.name!r}")
    if files := tokenizer_files(src):
        directory = Path(src.name).expanduser()
        for name in (f for f in JSON_FILES if f in files):
            _check_json(directory / name)
        return _own(str(directory), f"the tokenizer files of --model {src.name!r} ({', '.join(files)})",
                    directory)
    return _byte_level(src, config)


def describe_tokenizer(src: ModelSource, tokenizer) -> str:
    """The start-of-run table's row: whose tokenizer, and why the byte-level one where it stands in."""
    if src.kind in ("config", "weights") and not tokenizer_files(src):
        return "byte-level (--model has no tokenizer files)"
    if src.kind == "default":
        return "byte-level (the embedded model's)"
    return f"the model's own: {type(tokenizer).__name__}, {len(tokenizer)} tokens"


def _check_json(path: Path) -> None:
    """transformers' own error for a corrupt JSON file names no file ("Expecting value: line 1 ...")."""
    try:
        if isinstance(json.loads(path.read_bytes()), dict):
            return
        why = "not a JSON object"
    except (ValueError, OSError) as e:  # UnicodeDecodeError (random bytes) is a ValueError
        why = f"not valid JSON: {' '.join(str(e).split())}"
    raise BigfitError(f"{path} is {why}; repair or replace it (a model directory with no tokenizer files at "
                      "all gets the byte-level tokenizer)")


def _own(name: str, what: str, directory: Path | None = None):
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=False)  # a tokenizer's own code never runs
    except Exception as e:  # the tokenizers library raises bare Exceptions ("Error while initializing BPE")
        raise BigfitError(f"{what} could not be loaded: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if len(tok.get_vocab()) <= len(set(tok.all_special_tokens)):
        # a tokenizer class whose vocabulary file is absent loads anyway, with its special tokens alone,
        # and tokenizes every text to nothing (GPT2Tokenizer without vocab.json: 1 token)
        wanted = getattr(tok, "vocab_files_names", {}).values() if directory else ()
        missing = [directory / f for f in wanted if not (directory / f).exists()]
        where = f"{missing[0]} is missing" if missing else what
        raise BigfitError(f"{where}: {type(tok).__name__} loads with {len(tok)} token(s) and no vocabulary; add the "
                          "vocabulary file or remove the tokenizer files")
    return tok


def _byte_level(src: ModelSource, config):
    tok = ByT5Tokenizer()
    vocab = getattr(config, "vocab_size", 0)
    if vocab < len(tok):
        raise BigfitError(f"--model {src.name!r} ships no tokenizer and its vocab_size {vocab} is smaller than "
                          f"the byte-level tokenizer's {len(tok)}; add tokenizer files or raise vocab_size")
    return tok
