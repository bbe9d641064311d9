"""The `bigfit` command: `bigfit train` and `bigfit consolidate`.

Settings come from the TrainConfig defaults, then a --config file, then flags actually given on
the command line, in that order. User mistakes exit with status 2 and one line, no traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from pathlib import Path

from .checks import validate
from .config import PIPELINE_SCHEDULES, PIPELINE_STRATEGIES, PRECISIONS, SPLIT_STRATEGIES, STRATEGIES, TrainConfig
from .settings import HOW, NOUNS, as_type, field_type, load_config_file, normalise, setting_value
from .distributed import launched_by_torchrun_env
from .errors import BigfitError


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line, `error: ...`, and exit status 2, as every other bigfit
    error (argparse's own prints the usage above it); under torchrun only rank 0 says it."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"error: {message}\n")
        self.exit(2)


def _flag_type(f: dataclasses.Field):
    """The converter of a field's flag: its annotated type, "auto" where the field takes it, exactly as
    a config file's value (settings.setting_value); a bad value is argparse's one line naming the flag."""
    def convert(text: str):
        try:
            return setting_value(f.name, text, in_file=False)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = field_type(f.name)[0].__name__  # what argparse calls the type, should it ever say
    return convert


def _number(base: type):
    """The converter of a `bigfit plan` flag that takes an int or a float."""
    def convert(text: str):
        try:
            return as_type(base, text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {NOUNS[base]} ({HOW[base]})") from None

    convert.__name__ = base.__name__
    return convert


def _field_help() -> dict[str, str]:
    """The trailing comment of each field in config.py is its help text."""
    import inspect

    from . import config

    helps = {}
    for line in inspect.getsource(config.TrainConfig).splitlines():
        name, _, rest = line.strip().partition(":")
        if "#" in rest:
            helps[name] = rest.split("#", 1)[1].strip()
    return helps


def _train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train or fine-tune a model", argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="YAML or JSON file of settings (any of the flags below)")
    p.add_argument("--deepspeed-config", help="a DeepSpeed JSON config: mapped onto bigfit's settings (flags win)")
    helps = _field_help()
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("extra", "resume", "consolidate", "probe_only"):
            continue
        if field_type(f.name)[0] is bool:
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action="store_true", help=helps.get(f.name))
            continue
        kw = dict(help=helps.get(f.name, ""), type=_flag_type(f))
        if f.name == "strategy":
            kw["help"] += f" ({', '.join(STRATEGIES + SPLIT_STRATEGIES + PIPELINE_STRATEGIES)})"
        if f.name == "precision":
            kw["help"] += f" ({', '.join(PRECISIONS)})"
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kw)
    p.add_argument("--resume", nargs="?", const="latest", help=helps["resume"])
    p.add_argument("--probe-only", dest="probe_only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-consolidate", dest="consolidate", action="store_false",
                   help="skip writing OUTPUT/model at the end")
    return p


def _plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="predict every strategy's memory and speed before launch")
    p.add_argument("--model", help="hub name or model directory (only config.json is read); default: the embedded T5")
    p.add_argument("--gpus", help="e.g. 8x16GB or 24GB,8GB (mixed sizes); default: this machine's GPUs")
    p.add_argument("--nodes", type=_number(int), default=1, help="nodes, each with --gpus")
    p.add_argument("--cpu-ram", default=None, help="host RAM per node, e.g. 256GB; default: this machine's")
    p.add_argument("--nvme", default="0B", help="NVMe per node usable for offload, e.g. 1TB")
    p.add_argument("--pcie-gbps", type=_number(float), help="host <-> GPU bandwidth per GPU, GB/s")
    p.add_argument("--intra-gbps", type=_number(float), help="GPU <-> GPU bandwidth inside a node, GB/s")
    p.add_argument("--inter-gbps", type=_number(float), help="bandwidth between nodes, GB/s")
    p.add_argument("--nvme-gbps", type=_number(float), help="NVMe bandwidth of one node, GB/s")
    p.add_argument("--cpu-tflops", type=_number(float),
                   help="model TFLOP/s the host reaches on blocks a device map puts there")
    p.add_argument("--batch-size", type=_number(int), default=32, help="global batch")
    p.add_argument("--micro-batch-size", type=_number(int), help="default: batch / GPUs")
    p.add_argument("--seq-len", type=_number(int), default=512, help="tokens per sample (source side)")
    p.add_argument("--target-len", type=_number(int), default=0, help="decoder tokens per sample (encoder-decoders)")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--chunks", type=_number(int), help="device_map: GPipe micro-batches per forward (default 1); "
                   "pipeline: micro-batches per micro-batch (default: the fewest that give every stage one)")
    p.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, help="pipeline: default 1f1b")
    p.add_argument("--stages-per-rank", type=_number(int),
                   help="pipeline: stages per process (interleaved: default 2)")
    p.add_argument("--delayed-update", action="store_true", help="zero2-offload: the host step overlaps the next step")
    p.add_argument("--offload-grads", default="host", choices=("host", "device"),
                   help="zero2-offload: gradients wait for the host step in RAM (host) or on the GPU (device)")
    p.add_argument("--nvme-host-gb", type=_number(float), default=0.0,
                   help="zero2-offload-nvme: GB of states per node kept in RAM")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--plot", help="write per-GPU memory bars to this PNG")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; a mistake in it exits with one line and status 2 (`_Parser`)."""
    parser = _Parser(prog="bigfit", description="Train models that do not fit on one device.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                metavar="{train,plan,consolidate}")  # what "required" errors name
    commands = {"train": _train_parser(sub), "plan": _plan_parser(sub)}
    c = commands["consolidate"] = sub.add_parser("consolidate",
                                                 help="sharded checkpoint -> one Hugging Face model directory")
    c.add_argument("checkpoint", help="a checkpoint directory (OUTPUT/checkpoints/step-N)")
    c.add_argument("out", help="the model directory to write")
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(_unrecognized(unknown, ns.command, commands[ns.command]))
    return ns


def _unrecognized(args: list[str], command: str, p: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments", with the closest flag of the command for each unknown one."""
    flags = [s for a in p._actions if a.help != argparse.SUPPRESS for s in a.option_strings]  # no public list
    guesses = [close[0] for a in args if a.startswith("-")
               for close in [difflib.get_close_matches(a.split("=", 1)[0], flags, 1)] if close]
    hint = f"did you mean {', '.join(guesses)}?" if guesses else f"see bigfit {command} --help"
    return f"unrecognized arguments: {' '.join(args)}; {hint}"


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """Defaults <- --config file <- --deepspeed-config <- flags given on the command line."""
    flags = {k: v for k, v in vars(ns).items() if k not in ("command", "config", "deepspeed_config")}
    values = load_config_file(ns.config) if getattr(ns, "config", None) else {}
    if getattr(ns, "deepspeed_config", None):
        values.update(_deepspeed(ns.deepspeed_config, {**values, **flags}))
    values.update(flags)
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def _deepspeed(path: str, so_far: dict) -> dict:
    from .deepspeed_config import load_deepspeed_config

    mapping = load_deepspeed_config(path, _world(so_far.get("nproc"), TrainConfig()))
    if _speaks():
        print(mapping.summary)
        if mapping.ignored:
            print(f"warning: DeepSpeed keys with no bigfit meaning, ignored: {', '.join(mapping.ignored)}")
        if mapping.automatic:
            print(f"note: handled by FSDP2 / bigfit themselves: {', '.join(mapping.automatic)}")
    return normalise(mapping.values, f"DeepSpeed config {path!r}")  # each value of its field's type


def _speaks() -> bool:
    """Messages about the command line are printed once: by the launcher, or by torchrun's rank 0."""
    return "BIGFIT_ERROR_FILE" not in os.environ and os.environ.get("RANK", "0") == "0"


def _world(nproc: int | None, cfg: TrainConfig) -> int:
    """Processes in the job: torchrun's WORLD_SIZE, else --nproc, else the default for the strategy."""
    return int(os.environ.get("WORLD_SIZE", 0)) or nproc or _default_nproc(cfg)


def _default_nproc(cfg: TrainConfig) -> int:
    if cfg.strategy in ("single", *SPLIT_STRATEGIES):
        return 1
    import torch

    return torch.cuda.device_count() or 2


def _check_gpus(nproc: int) -> None:
    import torch

    gpus = torch.cuda.device_count()
    if gpus and nproc > gpus:
        raise BigfitError(f"--nproc {nproc} needs one GPU per process, but {gpus} are visible; use --nproc {gpus} "
                          "or fewer (or CUDA_VISIBLE_DEVICES= to run on the CPU)")


def train_command(argv: list[str], ns: argparse.Namespace) -> int:
    from .launch import launch_local, write_error

    cfg = config_from_args(ns)
    if cfg.strategy == "auto":
        from .planning.command import auto_strategy

        # device_map is one process driving every GPU: a candidate unless --nproc or torchrun fix the processes
        one_process = cfg.nproc is None and not launched_by_torchrun_env()
        name, reason = auto_strategy(cfg, _world(cfg.nproc, cfg), one_process)
        if _speaks():
            print(f"--strategy auto -> {name}: {reason}")
        split = ["--device-map", "auto"] if name in SPLIT_STRATEGIES else []  # balanced as the plan was
        cfg = dataclasses.replace(cfg, strategy=name, **({"device_map": "auto"} if split else {}))
        argv = [*argv, "--strategy", name, *split]  # workers start from the decision, not from "auto"
    if "auto" in (cfg.batch_size, cfg.micro_batch_size):
        _check_gpus(_world(cfg.nproc, cfg))
        from .autobatch import choose_micro_batch

        micro, batch = choose_micro_batch(argv, cfg, _world(cfg.nproc, cfg), speaks=_speaks())
        cfg = dataclasses.replace(cfg, micro_batch_size=micro, batch_size=batch)
        argv = [*argv, "--micro-batch-size", str(micro), "--batch-size", str(batch)]
    if launched_by_torchrun_env():  # a worker: of bigfit's launcher or of torchrun
        from .train.loop import train

        try:
            train(cfg)
        except Exception as e:
            if not os.environ.get("BIGFIT_ERROR_FILE"):
                raise  # under torchrun: its own error handling shows it
            write_error(e)  # bigfit's launcher shows the first failure, once
            from .autobatch import exit_status

            return exit_status(e)
        return 0
    nproc = cfg.nproc or _default_nproc(cfg)
    _check_gpus(nproc)
    from .train.job import prepare

    job = prepare(cfg, nproc)  # every check that needs no process, before any process starts
    if cfg.strategy == "device_map":  # the map against the model's stacks, on the meta device
        from .device_map.strategy import check

        check(job.cfg, job.model_config)
    if cfg.strategy == "pipeline":  # the cut into stages, on the meta device
        from .pipeline import check

        check(job.cfg, job.model_config, nproc)
    if nproc == 1:
        from .train.loop import train

        train(cfg)
        return 0
    return launch_local(argv, nproc, Path(cfg.output_dir) / "logs")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = parse_args(argv)
    try:
        if ns.command == "train":
            return train_command(argv, ns)
        if ns.command == "plan":
            from .planning.command import plan_command

            return plan_command(ns)
        from .train.consolidate import consolidate

        print(f"wrote {consolidate(ns.checkpoint, ns.out)}")
        return 0
    except BigfitError as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank finds the same mistake
            print(f"error: {e}", file=sys.stderr)
        return 2
