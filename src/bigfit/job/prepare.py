"""A resolved job made ready to run in this process: its model source and config, tokenizer, data and
resume point (`Prepared`). Whoever starts the job (bigfit's launcher, a one-process job, the Python
API) runs `prepare`, which also checks everything that needs the model and data but no process, so a
user mistake is one line before any work; its workers run `load` on the job the starter wrote, which
reads the tokenized data the starter left them (data/handoff.py) and checks nothing again."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ..adapters.lora import LoraSettings, check_targets
from ..data import Dataset, build_dataset, digits_task, read_examples
from ..data import cache, handoff
from ..data.arrays import first, longest
from ..data.chat import require_template
from ..data.digest import examples_digest
from ..context import check_context_model
from ..data.tokenize import check_enough
from ..errors import BigfitError
from ..layout.plan import ParallelPlan
from ..loading.files import check_files
from ..models.source import ModelSource, build_model, is_seq2seq, load_config, locate
from ..models.tokenizer import describe_tokenizer, load_tokenizer
from ..outputs import ckptdir
from ..settings.config import TrainConfig
from ..settings.userfiles import read_text
from .resolution import Job

EMBEDDED_TRAIN_SAMPLES = 4000


@dataclass
class Prepared:
    job: Job  # the resolved job; its data names what this process read (digest, lengths, tokenized dir)
    source: ModelSource
    model_config: object
    tokenizer: object
    seq2seq: bool
    dataset: Dataset
    resume_from: Path | None
    lora: LoraSettings | None = None  # LoRA adapters on a frozen base (adapters/lora.py); None: full fine-tuning

    @property
    def cfg(self) -> TrainConfig:
        return self.job.cfg

    @property
    def plan(self) -> ParallelPlan:  # how the model is spread over the processes (layout/plan.py)
        return self.job.plan

    @property
    def data_sha256(self) -> str | None:  # the examples' sha256 where --data is no single file: runinfo.identity
        return self.job.data.sha256


def prepare(job: Job) -> Prepared:
    """`job` ready to run here, after every check that needs its model and data (the starter's)."""
    cfg = job.cfg
    source = locate(cfg.model)
    model_config = load_config(source)
    check_files(source)  # the weight files open (headers only): the rank-0 path reads them in a training process
    ready = _load(job, source, model_config)
    if ready.lora:  # its targets against the model's linear layers, on a weightless copy: one line before any work
        check_targets(build_model(source, model_config, cfg.seed, on_meta=True), ready.lora)
    return ready


def load(job: Job) -> Prepared:
    """`job` ready to run in a worker: its tokenized data mapped from where the starter left it."""
    source = locate(job.cfg.model)
    return _load(job, source, load_config(source))


def _load(job: Job, source: ModelSource, model_config) -> Prepared:
    cfg = job.cfg
    tokenizer = _tokenizer(cfg, source, model_config)
    seq2seq = is_seq2seq(model_config)
    if cfg.pack and seq2seq:
        raise BigfitError(f"--pack lays samples end to end for decoder-only models; {cfg.model or 'the embedded T5'} is "
                          "an encoder-decoder, whose sources and targets are separate sequences: leave --pack out")
    if (cfg.cp or 1) > 1:
        check_context_model(model_config, cfg.cp)
    resume_from = ckptdir.resolve_resume(cfg.resume, cfg.output_dir) if cfg.resume else None
    if job.data.tokenized:  # the starter's: mapped, not read again
        dataset, digest = handoff.read(Path(job.data.tokenized), tokenizer), job.data.sha256
    else:
        dataset, digest = _dataset(cfg, tokenizer, seq2seq)
    data = dataclasses.replace(job.data, sha256=digest, lengths=job.data.lengths or _lengths(cfg, dataset))
    if cfg.max_train_samples is not None and cfg.max_train_samples < len(dataset.train):
        dataset = dataclasses.replace(dataset, train=first(dataset.train, cfg.max_train_samples))
    return Prepared(job.with_data(data), source, model_config, tokenizer, seq2seq, dataset, resume_from,
                    LoraSettings.from_config(cfg))


def _lengths(cfg: TrainConfig, dataset: Dataset) -> tuple[int, int]:
    """The longest training sample's source and target tokens, at most the limits: what the planner rates."""
    src, tgt = longest(dataset.train)
    return max(1, min(cfg.max_source_len, src)), max(1, min(cfg.max_target_len, tgt))


def handed_over(ready: Prepared, where: Path) -> Job:
    """The job its workers run: `ready`'s, with its tokenized data left in `where` (a cache entry is
    handed over as itself) for every rank of the node to map."""
    return ready.job.with_data(dataclasses.replace(ready.job.data, tokenized=str(handoff.write(ready.dataset, where))))


def data_lengths(cfg: TrainConfig) -> tuple[int, int]:
    """The longest training sample's source and target tokens, at most --max-source-len /
    --max-target-len: what the planner rates (job/autoplan.py), since no batch is longer. The limits
    are caps, often far past the data: the embedded task's samples are 29 and 10 tokens at most, and
    rated at 128/128 a step of it read 5.3 s where 0.5 s is measured. The data read here is kept for
    `prepare` (_LAST): the starter tokenizes once."""
    source = locate(cfg.model)
    model_config = load_config(source)
    dataset, _ = _dataset(cfg, _tokenizer(cfg, source, model_config), is_seq2seq(model_config))
    return _lengths(cfg, dataset)


def _tokenizer(cfg: TrainConfig, source: ModelSource, model_config):
    tokenizer = load_tokenizer(source, model_config)
    if cfg.chat_template:  # the user's template over the tokenizer's own (or its lack of one)
        tokenizer.chat_template = read_text(cfg.chat_template, f"--chat-template {cfg.chat_template!r}",
                                            "a Jinja chat template file")
    return tokenizer


# The last dataset tokenized in this process, by what it depends on: `--strategy auto` and micro-batch
# auto plan at the data's lengths (data_lengths) before `prepare` reads the same data. Only data
# named by a file's path, size and time (or the embedded task) is reused: a directory or a hub name is
# read again.
_LAST: dict = {}
_DATA_FIELDS = ("model", "data", "data_encoding", "data_columns", "data_split", "data_config", "chat_template",
                "data_cache", "dataset_num_proc", "max_source_len", "max_target_len", "eval_samples", "seed", "pack")


def _dataset(cfg: TrainConfig, tokenizer, seq2seq: bool) -> tuple[Dataset, str | None]:
    """The tokenized samples, checked to hold one global batch (a number: "auto" is decided later)."""
    key = _data_key(cfg)
    if key is None or _LAST.get("key") != key:
        _LAST.clear()
        _LAST.update(key=key, value=_read_dataset(dataclasses.replace(cfg, batch_size=0), tokenizer, seq2seq))
    dataset = _LAST["value"][0]
    check_enough(len(dataset.train), len(dataset.eval), cfg.batch_size if isinstance(cfg.batch_size, int) else 0,
                 cfg.max_source_len, cfg.pack)
    return _LAST["value"]


def _data_key(cfg: TrainConfig) -> str | None:
    path = Path(cfg.data).expanduser() if cfg.data else None
    if path is not None and not path.is_file():
        return None
    stamp = (path.stat().st_size, path.stat().st_mtime_ns) if path else None
    return json.dumps([getattr(cfg, f) for f in _DATA_FIELDS] + [stamp], default=str)


def _read_dataset(cfg: TrainConfig, tokenizer, seq2seq: bool) -> tuple[Dataset, str | None]:
    """The tokenized samples, and the data's digest where --data is no single file (runinfo.identity):
    from the node's cache (data/cache.py) or tokenized here, in memory."""
    if cache.wanted(cfg):
        dataset, digest, _ = cache.tokenized(cfg, tokenizer, seq2seq)
        return dataset, digest
    digest = None
    if cfg.data:
        examples = read_examples(cfg.data, cfg.data_encoding, cfg.data_columns, cfg.data_split, cfg.data_config)
        digest = examples_digest(cfg.data, examples)
        if "messages" in examples[0]:
            require_template(tokenizer, cfg.model)
    else:
        # enough that the hold-out (a tenth at most: tokenize.held_out) is the --eval-samples asked for
        examples = digits_task(max(EMBEDDED_TRAIN_SAMPLES + cfg.eval_samples, 10 * cfg.eval_samples), seed=1234)
    return build_dataset(examples, tokenizer, seq2seq, max_source_len=cfg.max_source_len,
                         max_target_len=cfg.max_target_len, eval_samples=cfg.eval_samples,
                         seed=cfg.seed, min_train=cfg.batch_size, pack=cfg.pack), digest


def describe(job: Prepared, n_params: int, device, notes: list[str], trained: int | None = None) -> list[tuple[str, object]]:
    """The resolved configuration, as rows for the start-of-run table. `trained`: the parameters the
    optimizer steps (LoRA's adapters), when not all."""
    c, x = job.cfg, job.job.batching
    model = c.model or "embedded tiny T5 (3 encoder + 2 decoder blocks, tied embeddings)"
    data = c.data or "embedded task: number words -> digits"
    return [
        ("model", f"{model} [{job.source.kind}], {n_params / 1e6:.2f}M parameters"),
        ("tokenizer", describe_tokenizer(job.source, job.tokenizer)),
        ("data", f"{data}: {_train_samples(job)} / {len(job.dataset.eval)} eval samples" + _capped(job)),
        ("plan", f"{job.plan.describe()}; precision {c.precision}, on {x.world_size} x {device.type}"
                 + "".join(f"; {n}" for n in notes)),
        *([("prediction", job.job.prediction)] if job.job.prediction else []),
        ("batch", f"global {c.batch_size} = {x.data_parallel} data-parallel x {x.grad_accum} accumulation "
                  f"x micro-batch {c.micro_batch_size}" + _shared(job)),
        ("schedule", f"{c.max_steps} steps, {c.optimizer} lr {c.lr:g} ({c.warmup_type} warm-up {c.warmup_steps}, "
                     f"{c.lr_schedule} after), weight decay {c.weight_decay:g}, clip {c.max_grad_norm:g}, seed {c.seed}"),
        *([("lora", f"r {c.lora_r}, alpha {c.lora_alpha:g}, dropout {c.lora_dropout:g} on {c.lora_targets}: "
                    f"{trained / 1e6:.2f}M trained ({trained / n_params:.2%}), the base frozen")] if job.lora else []),
        ("eval", f"{_eval_when(job)}: loss" + _eval_extras(job) if job.dataset.eval else "none (no held-out samples)"),
        ("checkpoints", (f"{_every(c.save_every)}, in {Path(c.output_dir) / 'checkpoints'}" if c.checkpoints
                         else "none (--no-checkpoints): nothing to resume from, no model directory")
                        + (f"; resuming from {job.resume_from}" if job.resume_from else "")),
    ]


def _shared(job: Prepared) -> str:
    """Who sees each data-parallel share whole: pipeline positions (in chunks) and tensor-parallel peers."""
    p, parts = job.plan, []
    if p.pp > 1:
        parts.append(f"all {p.pp} pipeline stages see it whole, in {p.chunks} chunks")
    if p.cp > 1:
        parts.append(f"{p.cp} context-parallel ranks each take a slice of every sequence")
    if p.tp > 1:
        parts.append(f"{p.tp} tensor-parallel ranks compute each sample together")
    return f" ({'; '.join(parts)})" if parts else ""


def _every(steps: int) -> str:
    """When the loop does a thing done every `steps` steps and at the end (0: at the end only)."""
    return f"every {steps} steps and at the end" if steps else "at the end only"


def _eval_when(job: Prepared) -> str:
    """When the loop evaluates: at step 0 (the baseline, unless --no-eval-on-start or resumed past it),
    every --eval-every steps, and at the last step."""
    c = job.cfg
    if not (c.eval_on_start and not job.resume_from):
        return _every(c.eval_every)
    return f"at step 0, every {c.eval_every} steps and at the end" if c.eval_every else "at step 0 and at the end"


def _capped(job: Prepared) -> str:
    """A word where the hold-out is less than --eval-samples: the default's, capped at a tenth of small data."""
    held, asked = len(job.dataset.eval), job.cfg.eval_samples
    return f" (--eval-samples {asked}: at most a tenth of the data is held out)" if held < asked else ""


def _eval_extras(job: Prepared) -> str:
    c = job.cfg
    if not job.seq2seq:
        return ", perplexity"
    if job.plan.pp > 1:  # generate() would need every stage in one process
        return "; no generate() across pipeline stages (generate with OUTPUT/model)"
    return f", beam-{c.num_beams} generate, BLEU and exact match"


def _train_samples(job: Prepared) -> str:
    d = job.dataset
    where = f" (mapped from {d.cached})" if d.cached else ""
    if d.packed:
        return (f"{d.packed} train samples packed into {len(d.train)} sequences of up to {job.cfg.max_source_len} "
                f"tokens{where}")
    return f"{len(d.train)} train{where}"
