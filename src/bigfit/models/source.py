"""Finding, building and describing the model and its tokenizer.

`--model` may be a hub name, a local directory with weights, or a directory holding only
config.json (random init). With no `--model`, the embedded default is a tiny T5 built from config:
unequal encoder/decoder depth and tied embeddings, the shape that breaks naive model parallelism.
When a model directory holds no tokenizer file at all, a byte-level tokenizer (ByT5's, which needs
no files) is used, so nothing is ever downloaded for the default job or the tests; tokenizer files
that are there must load (tokenizer.py). A config.json is checked where it is read: the model must
build from it on the meta device, or one line names the key that stops it.
"""
from __future__ import annotations

import contextlib
import copy
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, GenerationConfig
from transformers.utils import logging as hf_logging

from ..errors import BigfitError

BYTE_VOCAB = 384  # ByT5: 3 specials + 256 bytes + 125 sentinel ids (tokenizer.py's byte-level tokenizer)

# The embedded default: about 0.9M parameters, learns the embedded task in a few hundred steps on a CPU.
DEFAULT_T5 = dict(
    model_type="t5", vocab_size=BYTE_VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=3,
    num_decoder_layers=2, num_heads=4, dropout_rate=0.0, tie_word_embeddings=True,
    feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from. `kind` is default | config (random init) | weights | hub."""

    kind: str
    name: str | None


def locate(model: str | None) -> ModelSource:
    """Classify `--model` without loading anything heavy; raises BigfitError for a bad local path."""
    if model is None:
        return ModelSource("default", None)
    p = Path(model).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise BigfitError(f"--model {model!r} is a path but holds no config.json; give a Hugging Face "
                              "model directory (config.json, optionally weights) or a hub name")
        has_weights = any((p / f).exists() for f in WEIGHT_FILES)
        return ModelSource("weights" if has_weights else "config", str(p))
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep + os.sep in model:
        raise BigfitError(f"--model {model!r} does not exist; give a local model directory or a hub name "
                          "like 'google-t5/t5-small'")
    return ModelSource("hub", model)


def load_config(src: ModelSource):
    if src.kind == "default":
        cfg = dict(DEFAULT_T5)
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    try:
        config = AutoConfig.from_pretrained(src.name, trust_remote_code=False)  # bigfit runs no model's own code
    except Exception as e:
        # OSError / ValueError: no config.json, not JSON, an unknown model_type. transformers 5's typed
        # config classes raise huggingface_hub's StrictDataclassError for a value of the wrong type
        # (`"hidden_size": "big"`), no subclass of either: its cause, a TypeError or ValueError, is
        if isinstance(e, (OSError, ValueError)):  # their messages name the file where it is one
            raise BigfitError(f"--model {src.name!r} could not be loaded: {str(e).splitlines()[0]}") from None
        if not isinstance(e.__cause__, (TypeError, ValueError)):
            raise
        raise BigfitError(f"--model {src.name!r} could not be loaded: {_config_file(src)}: "
                          f"{' '.join(str(e).split())}") from None
    config.__dict__.pop("auto_map", None)  # its code: no later from_config asks to run it (safeload.model_config)
    _check_builds(src, config)
    if is_seq2seq(config) and getattr(config, "decoder_start_token_id", None) is None:
        # the decoder's first input: without it the first training step fails inside transformers
        raise BigfitError(f"--model {src.name!r}: its config.json has no decoder_start_token_id, which an "
                          "encoder-decoder needs to shift its labels; add it (T5: 0, the pad id)")
    return config


def _config_file(src: ModelSource) -> str:
    return str(Path(src.name).expanduser() / "config.json") if src.kind != "hub" else f"config.json of {src.name!r}"


_BUILT: set[str] = set()  # the configs that built in this process


def _check_builds(src: ModelSource, config) -> None:
    """The model builds from `config` on the meta device (shapes only: 0.08 s for an 8B Llama's, 0.2 s
    for a 70B's, after the model class's import, which training pays anyway), so that a value no type
    check catches (a negative size, an unknown activation) is one line naming its key before any
    process starts, not a traceback in one that trains."""
    built = f"{type(config).__name__}:{config.to_json_string()}"
    if built in _BUILT:  # load_config runs up to four times in a launcher: a model of 60k modules takes seconds
        return
    try:
        meta_model(copy.deepcopy(config))  # a copy: from_config may write into the config it is given
        _BUILT.add(built)
    except Exception as e:
        key = _culprit(config)
        what = f"{type(e).__name__}: {' '.join(str(e).split())}"
        if key is None:
            raise BigfitError(f"{_config_file(src)}: the model cannot be built from it ({what})") from None
        raise BigfitError(f"{_config_file(src)}: \"{key}\": {getattr(config, key, None)!r} does not build the "
                          f"model ({what}); correct it, or remove it for the default") from None


def _culprit(config) -> str | None:
    """The key of `config` that, left at its class's default, lets the model build: found by trying
    each, so no table of keys and their valid ranges has to follow transformers. Only on the error
    path; a failing try stops at the first layer that meets the bad value."""
    values = config.to_diff_dict()
    with warnings.catch_warnings(), _transformers_quiet():  # the tries' warnings are no news to the user
        warnings.simplefilter("ignore")
        for key in values:
            try:
                meta_model(type(config).from_dict({k: v for k, v in values.items() if k != key}))
                return key
            except Exception:
                continue
    return None


@contextlib.contextmanager
def _transformers_quiet():
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def is_seq2seq(config) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


def meta_model(config) -> torch.nn.Module:
    """The model class for `config` on the meta device: shapes only, for the checks and plans made
    before any weight exists."""
    auto = AutoModelForSeq2SeqLM if is_seq2seq(config) else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def build_model(src: ModelSource, config, seed: int, on_meta: bool = False) -> torch.nn.Module:
    """The model in fp32 on the CPU: pretrained weights, or random init from `seed`. `on_meta`:
    shapes only, no memory; every rank builds this when it fills its own storage after the plan's
    transforms (bigfit.loading), and on the rank-0 path the other ranks do, to receive rank 0's."""
    auto = AutoModelForSeq2SeqLM if is_seq2seq(config) else AutoModelForCausalLM
    torch.manual_seed(seed)
    if on_meta:
        with torch.device("meta"):
            model = auto.from_config(config, dtype=torch.float32)
        if src.kind in ("weights", "hub"):
            _as_from_pretrained(model, src.name)
    elif src.kind in ("weights", "hub"):
        try:
            model = auto.from_pretrained(src.name, dtype=torch.float32, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise BigfitError(f"weights of --model {src.name!r} could not be loaded: {e}") from None
    else:
        model = auto.from_config(config, dtype=torch.float32)
    # training never needs the KV cache (evaluation asks for it itself); T5's stacks keep config copies
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        if hasattr(config, "use_cache"):
            config.use_cache = False
    # training mode: from_pretrained returns its model in eval mode, so a fine-tune from weights would
    # train with its dropout off; the Trainer puts the model in training mode too (evaluation puts it
    # in eval mode and back, training/evaluate.py)
    return model.train()


def _as_from_pretrained(model: torch.nn.Module, name: str) -> None:
    """What from_pretrained gives besides the weights, for a model whose weights come later: the
    generation config saved beside the weights (from the local files only, as the weights are)."""
    if model.can_generate():
        try:
            model.generation_config = GenerationConfig.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError):
            pass  # none saved: the one derived from the model config stays


def block_lists(model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The transformer block stacks: under each top-level child, the longest ModuleList whose items
    all share one class (encoder.block and decoder.block for T5, transformer.h for GPT-2, model.layers
    for Llama). Sharding, checkpointing and splitting all work per block."""
    found = []
    for top_name, top in model.named_children():
        best = None
        for name, mod in top.named_modules():
            if isinstance(mod, torch.nn.ModuleList) and len(mod) and len({type(m) for m in mod}) == 1:
                if best is None or len(mod) > len(best[1]):
                    best = (f"{top_name}.{name}" if name else top_name, mod)
        if best:
            found.append(best)
    return found


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def owners(model: torch.nn.Module) -> dict[int, list]:
    """id(parameter) -> every (module, attribute name) that holds it: tied parameters have several."""
    out: dict[int, list] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mod, name))
    return out
