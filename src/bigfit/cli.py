"""The `bigfit` command: `bigfit train`, `bigfit plan`, `bigfit bench` and `bigfit consolidate`.

The flags of the first three are generated from the settings schema (settings/reading.py): one flag per
declared setting a command takes, its type, default and help the field's. Settings come from the
defaults, then a --config file, then flags actually given on the command line, in that order. User
mistakes exit with status 2 and one line, no traceback.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys

from .common.launchers import from_slurm
from .common.processes import interrupt_in, interrupt_name, launched_job, stamp_start
from .errors import BigfitError
from .job.checks import validate
from .settings.bench import BenchSettings
from .settings.config import BENCH_DECIDES, CHOICES, FLAG_ALONE, TrainConfig
from .settings.deepspeed import load_deepspeed_config
from .settings.planflags import ALIASES
from .settings.reading import (COMMANDS, INTERNAL, field_type, load_config_file, normalise, refusal, schema,
                               setting_value)


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line, `error: ...`, and exit status 2, as every other bigfit
    error (argparse's own prints the usage above it); under torchrun only rank 0 says it."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"error: {message}\n")
        self.exit(2)


def _flag_type(name: str):
    """The converter of a setting's flag: its annotated type, "auto" where the field takes it, exactly as
    a config file's value (settings.setting_value); a bad value is argparse's one line naming the flag."""
    def convert(text: str):
        try:
            return setting_value(name, text, in_file=False)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = field_type(name)[0].__name__  # what argparse calls the type, should it ever say
    return convert


def _add_settings(p: argparse.ArgumentParser, command: str) -> None:
    """A flag for each setting `command` takes (settings.schema), its help the field's comment and, where
    not every command takes it, which do. A bool is a switch: --NAME, or --no-NAME where it is on by
    default; `bigfit plan`'s choice settings offer their values (train and bench check them in job/checks.py)."""
    for s in schema(command).values():
        only = f" ({' and '.join(s.commands)} only)" if len(s.commands) < len(COMMANDS) else ""
        kw = {"dest": s.name, "help": argparse.SUPPRESS if s.name in INTERNAL else s.help + only}
        if field_type(s.name)[0] is bool:
            on = s.default is True
            p.add_argument("--no-" + s.flag[2:] if on else s.flag, action="store_false" if on else "store_true", **kw)
            continue
        if s.name in FLAG_ALONE:
            kw.update(nargs="?", const=FLAG_ALONE[s.name])
        if command == "plan" and s.name in CHOICES:  # strings here; plan_settings converts "auto"
            p.add_argument(s.flag, choices=CHOICES[s.name], **kw)
            continue
        p.add_argument(s.flag, type=_flag_type(s.name), **kw)


def _train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train or fine-tune a model", argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="YAML or JSON file of settings (any of the flags below)")
    p.add_argument("--deepspeed-config", help="a DeepSpeed JSON config: mapped onto bigfit's settings (flags win)")
    _add_settings(p, "train")
    return p


def _bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", argument_default=argparse.SUPPRESS,
                       help="measure every strategy x precision on this machine: max batch, train and eval time",
                       description="For each strategy x precision: the largest micro-batch that runs, the time to "
                                   "train --train-samples samples and to evaluate --eval-samples with beam search, "
                                   "the metric, memory and speed, the planner's prediction beside each.")
    p.add_argument("--config", help="YAML or JSON file of training settings (any of the flags below)")
    _add_settings(p, "bench")
    return p


def _plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", argument_default=argparse.SUPPRESS,
                       help="predict every strategy's memory and speed before launch",
                       description="Rate every strategy for a job on a machine. The job's settings are bigfit "
                                   "train's, with its names and defaults, and the job rated is printed above the "
                                   "table: its samples at --data's longest, else at --max-source-len / "
                                   "--max-target-len tokens; --strategy names the job's own (every one is "
                                   "rated). Settings that change nothing in a plan (learning rate, outputs, "
                                   "evaluation) are bigfit train's alone and refused here.")
    p.add_argument("--config", help="YAML or JSON file of settings, as bigfit train reads it: the job's settings "
                                    "in it are rated, the rest are not used")
    _add_settings(p, "plan")
    for alias, name in ALIASES.items():
        p.add_argument("--" + alias.replace("_", "-"), dest=alias, type=_flag_type(name),
                       help=f"the same setting as --{name.replace('_', '-')} (its name here before)")
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
    """argparse's "unrecognized arguments", with what another command's setting is (`bigfit plan --resume`:
    bigfit train's), else the closest flag of the command for each unknown one."""
    named = [a.split("=", 1)[0][2:].replace("-", "_") for a in args if a.startswith("--")]
    if other := next((r for n in named for r in [refusal(n, command)] if r), None):
        return f"unrecognized arguments: {' '.join(args)}; {other}"
    flags = [s for a in p._actions if a.help != argparse.SUPPRESS for s in a.option_strings]  # no public list
    guesses = [close[0] for a in args if a.startswith("-")
               for close in [difflib.get_close_matches(a.split("=", 1)[0], flags, 1)] if close]
    hint = f"did you mean {', '.join(guesses)}?" if guesses else f"see bigfit {command} --help"
    return f"unrecognized arguments: {' '.join(args)}; {hint}"


def given_files(ns: argparse.Namespace) -> dict[str, str]:
    """The settings files the command line named ({"--config": path}): read into the settings before
    the output directory is claimed, they keep no trace there, and an --overwrite must spare them."""
    return {f"--{k.replace('_', '-')}": v for k in ("config", "deepspeed_config") if (v := getattr(ns, k, None))}


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


def bench_from_args(ns: argparse.Namespace) -> tuple[BenchSettings, TrainConfig]:
    """(BenchSettings, the TrainConfig every row starts from): bench's flags, then defaults <- --config
    file <- the training flags given."""
    given = {k: v for k, v in vars(ns).items() if k not in ("command", "config")}
    bench = BenchSettings(**{k: v for k, v in given.items() if schema("bench")[k].owner is BenchSettings})
    values = load_config_file(ns.config) if getattr(ns, "config", None) else {}
    if bad := sorted(set(values) & set(BENCH_DECIDES)):
        raise BigfitError(f"bigfit bench decides {', '.join(bad)} for each row itself; leave them out of --config")
    values.update({k: v for k, v in given.items() if schema("bench")[k].owner is TrainConfig})
    base = TrainConfig(**values)
    validate(base)
    return bench, base


def _deepspeed(path: str, so_far: dict) -> dict:
    from .commands.decide import speaks, world  # imported here, as in main: world() asks torch for the GPUs

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
    from_slurm()  # a task of an srun step is a rank, as under torchrun: before anything reads RANK
    argv = sys.argv[1:] if argv is None else argv
    job = launched_job()  # a worker of bigfit's launcher runs the job its launcher resolved: no argv to read
    ns = None if job else parse_args(argv)
    # each command's module is imported when it runs: `bigfit --help` and a mistyped flag or setting load
    # no torch, transformers or planner
    try:
        if job:
            from .commands.train import run_worker

            return run_worker(job)
        if ns.command == "train":
            cfg = config_from_args(ns)  # its mistakes before torch loads
            from .commands.train import train_command

            return train_command(argv, cfg, given_files(ns))
        if ns.command == "plan":
            from .commands.plan import plan_command

            return plan_command(ns)
        if ns.command == "bench":
            from .bench.driver import bench_command

            return bench_command(*bench_from_args(ns))
        from .outputs.consolidate import consolidate

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
