"""The `bigfit` command: `bigfit train`, `bigfit plan`, `bigfit bench` and `bigfit consolidate`.

Settings come from the TrainConfig defaults, then a --config file, then flags actually given on
the command line, in that order. User mistakes exit with status 2 and one line, no traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import re
import sys

from . import config
from .checks import validate
from .config import OPTIMIZER_STATES, PIPELINE_SCHEDULES, PRECISIONS, TrainConfig
from .deepspeed_config import load_deepspeed_config
from .settings import HOW, NOUNS, as_type, field_type, load_config_file, normalise, setting_value
from .errors import BigfitError
from .launch import interrupt_in, interrupt_name, launched_settings, stamp_start
from .planning.flags import add_lora_flags


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


def _field_help(cls=TrainConfig) -> dict[str, str]:
    """The help text of each field of a settings class (config.py's TrainConfig): its trailing comment,
    else the comment lines right above it (a field whose comment needs several lines), as `_shown` words it."""
    helps, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"    (\w+): [^#]*(?:#(.*))?$", line)
        if line.strip().startswith("#"):
            above.append(line.strip()[1:].strip())
            continue
        if field and not line.startswith("    def "):
            helps[field[1]] = _shown(field[2].strip() if field[2] else " ".join(above))
        above = []
    return helps


def _shown(comment: str) -> str:
    """A field's comment as --help says it: config.py's tuples of names (STRATEGIES) as their values, "None"
    (the field's unset value) as the default it stands for, and % doubled (argparse formats help with it)."""
    def names(m: re.Match) -> str:
        value = getattr(config, m[0], None)
        return ", ".join(value) if isinstance(value, tuple) else m[0]

    return re.sub(r"\bNone:", "default:", re.sub(r"\b[A-Z][A-Z0-9_]+\b", names, comment)).replace("%", "%%")


def _train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train or fine-tune a model", argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="YAML or JSON file of settings (any of the flags below)")
    p.add_argument("--deepspeed-config", help="a DeepSpeed JSON config: mapped onto bigfit's settings (flags win)")
    _train_fields(p, ("extra", "resume", "consolidate", "checkpoints", "eval_on_start", "probe_only"))
    p.add_argument("--resume", nargs="?", const="latest", help=_field_help()["resume"])
    p.add_argument("--probe-only", dest="probe_only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-consolidate", dest="consolidate", action="store_false",
                   help="skip writing OUTPUT/model at the end")
    p.add_argument("--no-checkpoints", dest="checkpoints", action="store_false",
                   help="save no checkpoint, the end's neither (so no OUTPUT/model): nothing to resume")
    p.add_argument("--no-eval-on-start", dest="eval_on_start", action="store_false",
                   help="skip the evaluation before the first step")
    return p


def _bench_parser(sub) -> argparse.ArgumentParser:
    from .bench.settings import BENCH_OWN, BenchSettings  # no torch

    p = sub.add_parser("bench", argument_default=argparse.SUPPRESS,
                       help="measure every strategy x precision on this machine: max batch, train and eval time",
                       description="For each strategy x precision: the largest micro-batch that runs, the time to "
                                   "train --train-samples samples and to evaluate --eval-samples with beam search, "
                                   "the metric, memory and speed, the planner's prediction beside each.")
    helps = _field_help(BenchSettings)
    for f in dataclasses.fields(BenchSettings):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            p.add_argument(flag, dest=f.name, action="store_true", help=helps.get(f.name))
        else:
            p.add_argument(flag, dest=f.name, type=_number(float if f.name.endswith("_s") else int)
                           if f.name.endswith(("_s", "_samples", "_steps")) else str, help=helps.get(f.name))
    p.add_argument("--config", help="YAML or JSON file of training settings (any of the flags below)")
    _train_fields(p, BENCH_OWN)
    return p


def _train_fields(p: argparse.ArgumentParser, skip: tuple[str, ...]) -> None:
    """A flag for each TrainConfig field not in `skip`, its help the field's comment."""
    helps = _field_help()
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        if field_type(f.name)[0] is bool:
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action="store_true", help=helps.get(f.name))
            continue
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, help=helps.get(f.name), type=_flag_type(f))


def _plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="predict every strategy's memory and speed before launch")
    p.add_argument("--model", help="hub name or model directory (only config.json is read); default: the embedded T5")
    p.add_argument("--gpus", help="e.g. 8x16GB, 24GB,8GB (mixed sizes) or 8xH100 (a GPU bigfit knows: its memory "
                   "and rates); default: this machine's GPUs")
    p.add_argument("--nodes", type=_number(int), default=1, help="nodes, each with --gpus")
    p.add_argument("--cpu-ram", default=None, help="host RAM per node, e.g. 256GB; default: this machine's")
    p.add_argument("--nvme", default="0B", help="NVMe per node usable for offload, e.g. 1TB")
    p.add_argument("--gpu-tflops", type=_number(float),
                   help="dense bf16 TFLOP/s one GPU reaches (the H200: 760 of its 989); default: its GPU's")
    p.add_argument("--gpu-mem-gbps", type=_number(float), help="one GPU's memory bandwidth, GB/s; default: its GPU's")
    p.add_argument("--pcie-gbps", type=_number(float), help="host <-> GPU bandwidth per GPU, GB/s")
    p.add_argument("--intra-gbps", type=_number(float), help="GPU <-> GPU bandwidth inside a node, GB/s")
    p.add_argument("--inter-gbps", type=_number(float), help="bandwidth between nodes, GB/s")
    p.add_argument("--nvme-gbps", type=_number(float), help="NVMe bandwidth of one node, GB/s")
    p.add_argument("--cpu-tflops", type=_number(float),
                   help="model TFLOP/s the host reaches on blocks a device map puts there")
    p.add_argument("--host-op-us", type=_number(float),
                   help="host microseconds to issue one forward operator and its backward in eager mode; "
                        "default: this machine's from --calibrate, else the H200 machine's 25")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's --host-op-us on its GPU (or CPU), keep it in the cache "
                        "($XDG_CACHE_HOME/bigfit; one that cannot be written: for this plan only), then plan")
    p.add_argument("--batch-size", type=_number(int), default=32, help="global batch")
    p.add_argument("--micro-batch-size", type=_number(int), help="default: batch / GPUs")
    p.add_argument("--seq-len", type=_number(int), default=512, help="tokens per sample (source side)")
    p.add_argument("--target-len", type=_number(int), default=0, help="decoder tokens per sample (encoder-decoders)")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS,
                   help="the training's precision, fp32 master weights either way (default bf16)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward instead of storing them")
    p.add_argument("--compile", action="store_true",
                   help="blocks compiled (bigfit train --compile): fewer kernels to issue")
    p.add_argument("--chunks", type=_number(int), help="device_map: GPipe micro-batches per forward (default 1); "
                   "pipeline: micro-batches per micro-batch (default: the fewest that give every stage one)")
    p.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, help="pipeline: default 1f1b")
    p.add_argument("--stages-per-rank", type=_number(int),
                   help="pipeline: stages per process (interleaved: default 2)")
    p.add_argument("--delayed-update", action="store_true", help="zero2-offload: the host step overlaps the next step")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="composed plans with --tp: the residual stream split by sequence")
    p.add_argument("--offload-grads", default="host", choices=("host", "device"),
                   help="zero2-offload: gradients wait for the host step in RAM (host) or on the GPU (device)")
    p.add_argument("--nvme-host-gb", type=_number(float), default=None,
                   help="zero2-offload-nvme: GB of states per node kept in RAM; 0: every state on the disk; "
                        "default: what the RAM leaves, as --strategy auto chooses")
    p.add_argument("--optimizer-states", default="auto", choices=(*OPTIMIZER_STATES, "auto"),
                   help="zero2-offload: the host's Adam moments (fp32, bf16, int8: with the master 12, 8, ~6 bytes a "
                        "parameter); auto: the most exact that fits, as --strategy auto chooses")
    for dim, what in (("tp", "tensor-parallel"), ("pp", "pipeline"), ("dp-shard", "sharded data-parallel"),
                      ("dp-replicate", "replicated data-parallel")):
        p.add_argument(f"--{dim}", type=_number(int), help=f"composed plans: only those with this {what} degree")
    add_lora_flags(p, _number)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--plot", help="write per-GPU memory bars to this PNG")
    return p


def parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """`bigfit`'s parser and each command's."""
    parser = _Parser(prog="bigfit", description="Train models that do not fit on one device.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                metavar="{train,plan,bench,consolidate}")  # what "required" errors name
    return parser, {"train": _train_parser(sub), "plan": _plan_parser(sub), "bench": _bench_parser(sub),
                    "consolidate": _consolidate_parser(sub)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; a mistake in it exits with one line and status 2 (`_Parser`)."""
    parser, commands = parsers()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(_unrecognized(unknown, ns.command, commands[ns.command]))
    return ns


def _consolidate_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser(
        "consolidate", help="sharded checkpoint -> one Hugging Face model directory (a --lora one: a peft adapter)",
        description="Write a checkpoint as a Hugging Face model directory (safetensors, config, tokenizer). A "
                    "--lora checkpoint becomes a peft adapter directory (adapter_config.json, "
                    "adapter_model.safetensors: PeftModel.from_pretrained(base, OUT)), or with --merge a model.")
    c.add_argument("checkpoint", help="a checkpoint directory (OUTPUT/checkpoints/step-N)")
    c.add_argument("out", help="the directory to write (new, or empty)")
    c.add_argument("--merge", action="store_true",
                   help="--lora checkpoints: write a full model with the adapters folded into the base weights "
                        "(W + B A alpha/r), which transformers loads without peft; the base, which LoRA "
                        "checkpoints do not hold, is made again from the run's --model (read, or its seeded init)")
    c.add_argument("--base", metavar="DIR", help="with --merge: the base model's directory, where the run's "
                                                  "--model is no longer")
    c.add_argument("--overwrite", action="store_true",
                   help="replace a model or adapter directory bigfit wrote there earlier (only its files)")
    return c


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
    from .training.command import speaks, world  # imported here, as in main: world() asks torch for the GPUs

    mapping = load_deepspeed_config(path, world(so_far.get("nproc"), TrainConfig()))
    if speaks():
        print(mapping.summary)
        if mapping.ignored:
            print(f"warning: DeepSpeed keys with no bigfit meaning, ignored: {', '.join(mapping.ignored)}")
        if mapping.automatic:
            print(f"note: handled by FSDP2 / bigfit themselves: {', '.join(mapping.automatic)}")
    return normalise(mapping.values, f"DeepSpeed config {path!r}")  # each value of its field's type


def main(argv: list[str] | None = None) -> int:
    stamp_start()
    argv = sys.argv[1:] if argv is None else argv
    ns = parse_args(argv)
    # each command's module is imported when it runs: `bigfit --help` and a mistyped flag or setting load
    # no torch, transformers or planner
    try:
        if ns.command == "train":
            decided = launched_settings()  # a worker of bigfit's launcher runs what the launcher decided
            cfg = TrainConfig(**decided) if decided else config_from_args(ns)
            from .training.command import train_command

            return train_command(argv, cfg)
        if ns.command == "plan":
            from .planning.command import plan_command

            return plan_command(ns)
        if ns.command == "bench":
            from .bench.command import bench_command

            from .bench.settings import from_args

            return bench_command(*from_args(ns))
        from .training.consolidate import consolidate

        out = consolidate(ns.checkpoint, ns.out, overwrite=ns.overwrite, merge=ns.merge, base=ns.base)
        adapter = not ns.merge and os.path.isfile(os.path.join(out, "adapter_config.json"))
        print(f"wrote {out}" + (" (a peft adapter: PeftModel.from_pretrained(base, it); --merge writes a model "
                                "with the adapters folded in)" if adapter else ""))
        return 0
    except BigfitError as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank finds the same mistake
            print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:
        # Ctrl-C, or SIGTERM where stop_on_sigterm makes it one (a one-process job), also as DCP wraps it
        # (launch.interrupt_in): the context managers on the way here released the output directory's
        # lock, and a checkpoint being saved is never marked complete. One line and the shell's 128 +
        # SIGINT, as the launcher of several processes says it; its workers are silent (it speaks for
        # them). Anything else keeps its traceback.
        if (interrupt := interrupt_in(e)) is None:
            raise
        if "BIGFIT_ERROR_FILE" not in os.environ and os.environ.get("RANK", "0") == "0":
            print(f"interrupted ({interrupt_name(interrupt)}): stopped", file=sys.stderr)
        return 130
