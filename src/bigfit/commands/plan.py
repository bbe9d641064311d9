"""`bigfit plan`: the job (TrainConfig, with `bigfit train`'s names and defaults), the model (meta/fake,
no weights) and the hardware described, plan, show: the job rated in one line above the table. The
planner's Job is made from the TrainConfig by job/autoplan.py, which also answers `bigfit train` about its own
job, so that a plan and a run of the same settings rate the same job."""
from __future__ import annotations

import json
from dataclasses import replace

from rich.console import Console

from ..adapters.lora import LoraSettings
from ..errors import BigfitError
from ..job.autoplan import _this_machine, default_processes, planner_job
from ..layout.plan import DIMS
from .calibrate import calibrate
from ..machine.hardware import (MAX_NODES, Hardware, calibration_path, gpu_rates, host_figures, host_ram, parse_gpus,
                                parse_size)
from ..models.source import load_config, locate
from ..planning.estimate import RESERVE
from ..planning.layouts import SHOWN, check_degrees, flag
from ..planning.quantized import check as check_4bit
from ..planning.longest import longest
from ..planning.report import (device_map_text, layout_table, longest_notes, longest_table, pipeline_text, plan_table,
                               plot_plan, rejected_text)
from ..planning.search import plan_for_config
from ..planning.tp_trace import split_counts
from ..settings.config import TrainConfig, auto_precision
from ..settings.planflags import ALIASES, LORA_FLAGS, PLAN_RANGES, PlanHardware, PlanOutput
from ..settings.reading import load_config_file, schema, setting_value

# the machine's rates, each more than 0: a 0 GB/s link would plan nonsense rather than fail
RATES = ("gpu_tflops", "gpu_mem_gbps", "pcie_gbps", "intra_gbps", "inter_gbps", "nvme_gbps", "cpu_tflops", "host_op_us")


def plan_settings(values: dict) -> tuple[TrainConfig, PlanHardware, PlanOutput]:
    """`bigfit plan`'s settings by name (its flags', a config file's, the Python API's; --seq-len and
    --target-len as spelled) as (the job: TrainConfig, the machine, the output), each number in its range
    (flags.PLAN_RANGES), the refusal naming the flag as the user wrote it."""
    values, spelled = dict(values), {}
    for alias, name in ALIASES.items():
        if alias in values:
            if name in values:
                raise BigfitError(f"--{alias.replace('_', '-')} and --{name.replace('_', '-')} are the same setting; "
                                  "keep one")
            values[name], spelled[name] = values.pop(alias), alias
    values = {k: setting_value(k, v, in_file=False) for k, v in values.items()}  # plan's choices come as text
    for name, value in values.items():
        r = PLAN_RANGES.get(name)
        if r and isinstance(value, (int, float)) and not isinstance(value, bool) and not r.holds(value):
            raise BigfitError(f"--{spelled.get(name, name).replace('_', '-')} must be {r.describe(note=False)}, "
                              f"got {value}")
    parts = {cls: {k: v for k, v in values.items() if schema("plan")[k].owner is cls}
             for cls in (TrainConfig, PlanHardware, PlanOutput)}
    return TrainConfig(**parts[TrainConfig]), PlanHardware(**parts[PlanHardware]), PlanOutput(**parts[PlanOutput])


def hardware_of(m: PlanHardware, cfg: TrainConfig) -> Hardware:
    """The machine `bigfit plan` rates: --gpus, else this one as `bigfit train` sees it (its GPUs, one a
    process, or its CPU shared by --nproc processes), with the other flags, each range-checked, since a
    0 GB GPU or a 0 GB/s link would plan nonsense rather than fail."""
    if not 1 <= m.nodes <= MAX_NODES:
        raise BigfitError(f"--nodes must be from 1 to {MAX_NODES}, got {m.nodes}")
    if m.gpus and cfg.nproc is not None:
        raise BigfitError(f"--nproc {cfg.nproc} counts this machine's processes, but --gpus {m.gpus!r} describes "
                          "other GPUs, one process each: give one or the other")
    if m.gpus:  # GPUs described: this host's issuing cost still applies where it was measured
        base = Hardware(gpu_bytes=tuple(parse_gpus(m.gpus)), cpu_ram=host_ram(), **host_figures("cuda"),
                        **gpu_rates(m.gpus))
    else:
        base = _this_machine(cfg.nproc or default_processes(cfg), cfg.strategy)
    if min(base.gpu_bytes) <= RESERVE:  # else every capacity in the plan would be negative
        which = f"--gpus {m.gpus!r}" if m.gpus else "this machine's GPUs"
        raise BigfitError(f"{which}: the plan keeps {RESERVE / 2**30:g} GiB of every GPU for the CUDA context and "
                          "allocator, so each needs more than that, like 16GB")
    kw = {"nodes": m.nodes, "nvme": parse_size(m.nvme, "--nvme")}
    if m.cpu_ram:
        kw["cpu_ram"] = parse_size(m.cpu_ram, "--cpu-ram")
        if kw["cpu_ram"] <= 0:
            raise BigfitError(f"--cpu-ram {m.cpu_ram!r} holds nothing; give each node's host RAM, like 256GB")
    for name in RATES:
        if getattr(m, name) is not None:
            if getattr(m, name) <= 0:
                raise BigfitError(f"--{name.replace('_', '-')} must be more than 0, got {getattr(m, name)}")
            kw[name] = getattr(m, name)
    return Hardware(**{**vars(base), **kw})


def plan_precision(m: PlanHardware, hw: Hardware) -> str:
    """--precision auto as `bigfit plan` rates it: bf16 on GPUs (every GPU bigfit knows by name computes it;
    this machine's: where torch says so, as `bigfit train` decides), fp32 on the CPU."""
    if hw.device == "cpu":
        return "fp32"
    return "bf16" if m.gpus else auto_precision()


def settings_of_args(ns) -> tuple[TrainConfig, PlanHardware, PlanOutput]:
    """`bigfit plan`'s parsed arguments as its settings: defaults <- --config file (the job's settings in
    it; those only bigfit train takes are not used) <- flags given."""
    values = load_config_file(ns.config, "plan") if getattr(ns, "config", None) else {}
    values = {k: v for k, v in values.items() if k in schema("plan")}
    return plan_settings({**values, **{k: v for k, v in vars(ns).items() if k not in ("command", "config")}})


def plan_command(ns) -> int:
    """`bigfit plan` of its parsed arguments."""
    cfg, machine, out = settings_of_args(ns)
    if out.max_seq_len:
        return _longest_command(cfg, machine, out)
    p, hw, fixed, rated = compute_plan(cfg, machine)
    if out.json:
        print(json.dumps(plan_json(p, rated), indent=1))
    else:
        console = Console(width=150)  # the table is wide; pipes would otherwise cut it at 80 columns
        console.print(rated["text"], markup=False)
        _show(console, p, fixed)
    if out.plot:
        plot_plan(p, min(hw.gpu_bytes), out.plot)
        if not out.json:
            print(f"wrote {out.plot}")
    return 0


def plan_json(p, rated: dict) -> dict:
    """The plan as `--json` prints it, its "job" with what `bigfit plan` says it rated."""
    out = p.to_json()
    return {**out, "job": {**out["job"], **rated}}


def compute_plan(cfg: TrainConfig, machine: PlanHardware):
    """(the plan, the hardware, the degrees fixed by flags, the job it rated in words) of `bigfit plan`'s
    settings: the planner's Job made from `cfg` as for `bigfit train` (job/autoplan.py planner_job)."""
    config, hw, fixed, cfg, job = _planned(cfg, machine)
    p = plan_for_config(config, hw, job, layouts=fixed)
    if fixed and not p.layouts and p.layout_rejected:  # the degrees asked for rule out every composed plan
        r = p.layout_rejected[0]
        raise BigfitError(f"{' '.join(f'--{flag(d)} {v}' for d, v in fixed.items())}: {r.group} ({r.name}: {r.detail})")
    return p, hw, fixed, rated_job(cfg, job, hw, machine)


def compute_longest(cfg: TrainConfig, machine: PlanHardware) -> tuple[list, list, dict]:
    """`bigfit plan --max-seq-len`: (the named rows' longest sequences a sample, the composed plans',
    the job rated with its micro-batch and the machine) at the job's micro-batch (1 unless
    --micro-batch-size gives one): planning/longest.py."""
    config, hw, fixed, cfg, job = _planned(cfg, machine)
    named, composed, micro = longest(config, hw, job, fixed)
    rated = rated_job(cfg, replace(job, micro_batch=micro, batch_size=micro * hw.world_size), hw, machine)
    rated["text"] = rated["text"].replace(f"{job.seq_len} tokens a sample", "the longest sequence a sample")
    return named, composed, {**rated, "micro_batch": micro, "hardware": hw.describe()}


def longest_json(named: list, composed: list, rated: dict) -> dict:
    """--max-seq-len as `--json` prints it and bigfit.plan(max_seq_len=True) returns it."""
    return {"job": rated, "strategies": [r.to_json() for r in named], "composed": [r.to_json() for r in composed]}


def _longest_command(cfg: TrainConfig, machine: PlanHardware, out: PlanOutput) -> int:
    named, composed, rated = compute_longest(cfg, machine)
    if out.json:
        print(json.dumps(longest_json(named, composed, rated), indent=1))
        return 0
    console = Console(width=150)
    console.print(rated["text"], markup=False)
    console.print(longest_table(named, composed, rated["hardware"], rated["micro_batch"], SHOWN))
    for line in longest_notes(named):
        console.print(line, markup=False)
    if composed:
        fit = sum(1 for r in composed if r.tokens)
        console.print(f"  composed plans: {fit} of {len(composed)} hold some length; the {min(SHOWN, fit)} that "
                      "hold the longest are above (--json: every one)")
    return 0


def _planned(cfg: TrainConfig, machine: PlanHardware):
    """(model config, hardware, fixed degrees, cfg with its precision, the planner's Job) of the settings."""
    config = load_config(locate(cfg.model))  # a bad --model is reported before any measuring
    if machine.calibrate:
        print(_calibrated(calibrate()))
    hw = hardware_of(machine, cfg)
    fixed = {d: getattr(cfg, d) for d in DIMS if getattr(cfg, d) is not None}  # the composed plans' degrees
    check_degrees(fixed, hw, *split_counts(config))
    cfg = replace(cfg, precision=cfg.precision or plan_precision(machine, hw))
    lora = LoraSettings.checked(cfg.lora, {f: getattr(cfg, f) for f in LORA_FLAGS
                                           if getattr(cfg, f) != getattr(TrainConfig, f)}, "plan")
    if cfg.load_in_4bit:  # train's refusals; the composed plans' degrees stand for its --strategy
        check_4bit(lora is not None, cfg.precision, fixed)
    job = planner_job(cfg, config, hw.world_size, _data_lengths(cfg) if cfg.data else None)
    return config, hw, fixed, cfg, job


def _data_lengths(cfg: TrainConfig) -> tuple[int, int]:
    """--data's longest sample, read and tokenized as `bigfit train` reads it (the data stack loads here only)."""
    from ..job.prepare import data_lengths

    return data_lengths(cfg)


def rated_job(cfg: TrainConfig, job, hw: Hardware, machine: PlanHardware) -> dict:
    """The job a plan rated, as its --json's "job" adds it and as one line above the table."""
    where = (f"{hw.world_size} GPU(s) described" if machine.gpus else
             f"{hw.world_size} process(es) on this machine's {'CPU' if hw.device == 'cpu' else 'GPUs'}")
    tokens = f"{job.seq_len} source / {job.target_len} target" if job.target_len else f"{job.seq_len}"
    lora = (f"LoRA r{job.lora.r} on {job.lora.targets}" + (" over a 4-bit base" if job.load_in_4bit else "")
            if job.lora else "full fine-tuning")
    text = (f"job: {cfg.model or 'the embedded tiny T5'}, global batch {job.batch_size} / micro-batch "
            f"{job.micro(hw.world_size)}, {tokens} tokens a sample ("
            + (f"the longest of {cfg.data}" if cfg.data else "--max-source-len / --max-target-len")
            + f"), {job.precision}, activations "
            f"{'auto (each row its own)' if job.choose_activations else job.keeping}, {lora}, "
            f"strategy {cfg.strategy}, {where}")
    return {"model": cfg.model, "data": cfg.data, "strategy": cfg.strategy, "processes": hw.world_size,
            "text": text}


def _calibrated(r: dict) -> str:
    """What --calibrate measured, and where it was kept (or why not: this plan uses it all the same)."""
    adam = ", ".join(f"{'torch fused' if f == 'torch' else f} {v / 1e9:.2f}" for f, v in r["host_adam"].items())
    kept = (f"not kept: {r['not_kept']}; this plan uses them, later ones can with --host-op-us {r['host_op_us']:.1f}"
            if r["not_kept"] else f"kept in {calibration_path()}")
    return (f"calibrated: the host issues a forward operator with its backward in {r['host_op_us']:.1f} us on "
            f"{r['device']} ({r['operators']} operators in {r['step_s'] * 1e3:.1f} ms); its Adam step takes G "
            f"parameters/s: {adam}; {kept}")


def _show(console, p, fixed: dict) -> None:
    console.print(plan_table(p))
    for c in p.candidates:
        if c.why_not:
            console.print(f"  {c.estimate.name}: {c.why_not}")
    restricted = " with " + ", ".join(f"{d} {v}" for d, v in fixed.items()) if fixed else ""
    table = layout_table(p, SHOWN, restricted)
    if table is not None:
        console.print(table)
    if p.layouts is not None and not p.layouts and not p.layout_rejected:
        console.print(f"  no composed plan{restricted}: the named rows above rate that layout")
    for line in rejected_text(p):
        console.print(line)
    console.print(f"[bold]recommended[/bold]: {p.recommended or 'none'}: {p.reason}")
    pick = p.layout_pick
    console.print(f"[bold]composed[/bold]: {pick.estimate.name if pick else 'none recommended'}: {p.layout_reason}")
    for note in p.notes:
        console.print(f"  {note}")
    console.print(device_map_text(p.device_map))
    console.print(pipeline_text(p.pipeline))
