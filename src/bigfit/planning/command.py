"""`bigfit plan`: describe the model (meta/fake, no weights) and the hardware, plan, show. What
`bigfit train` asks the planner of its own job is auto.py."""
from __future__ import annotations

import json

from rich.console import Console

from ..calibration import calibrate
from ..errors import BigfitError
from ..hardware import (MAX_NODES, Hardware, calibration_path, detect, gpu_rates, host_figures, host_ram, parse_gpus,
                        parse_size)
from ..lora import LoraSettings
from ..models import load_config, locate
from ..parallel.plan import DIMS
from .auto import planned_states
from .estimate import RESERVE
from .flags import LORA_FLAGS
from .layouts import SHOWN, check_degrees, flag
from .quantized import check as check_4bit
from .report import device_map_text, layout_table, pipeline_text, plan_table, plot_plan, rejected_text
from .search import Job, plan_for_config
from .tp_trace import split_counts

# `bigfit plan` flags that must be more than 0 (None: the default), the hardware's rates among them...
POSITIVE = ("batch_size", "seq_len", "chunks", "stages_per_rank", "micro_batch_size", *DIMS)
RATES = ("gpu_tflops", "gpu_mem_gbps", "pcie_gbps", "intra_gbps", "inter_gbps", "nvme_gbps", "cpu_tflops", "host_op_us")
# ...and those that may be 0 too
AT_LEAST_0 = ("target_len", "nvme_host_gb")


def hardware_from_args(ns) -> Hardware:
    """The machine `bigfit plan` is asked about: --gpus (else this one's) and the other flags, each
    range-checked, since a 0 GB GPU or a 0 GB/s link would plan nonsense rather than fail."""
    if not 1 <= ns.nodes <= MAX_NODES:
        raise BigfitError(f"--nodes must be from 1 to {MAX_NODES}, got {ns.nodes}")
    if ns.gpus:  # GPUs described: this host's issuing cost still applies where it was measured
        base = Hardware(gpu_bytes=tuple(parse_gpus(ns.gpus)), cpu_ram=host_ram(), **host_figures("cuda"),
                        **gpu_rates(ns.gpus))
    else:
        base = detect()
    if min(base.gpu_bytes) <= RESERVE:  # else every capacity in the plan would be negative
        which = f"--gpus {ns.gpus!r}" if ns.gpus else "this machine's GPUs"
        raise BigfitError(f"{which}: the plan keeps {RESERVE / 2**30:g} GiB of every GPU for the CUDA context and "
                          "allocator, so each needs more than that, like 16GB")
    kw = {"nodes": ns.nodes, "nvme": parse_size(ns.nvme, "--nvme")}
    if ns.cpu_ram:
        kw["cpu_ram"] = parse_size(ns.cpu_ram, "--cpu-ram")
        if kw["cpu_ram"] <= 0:
            raise BigfitError(f"--cpu-ram {ns.cpu_ram!r} holds nothing; give each node's host RAM, like 256GB")
    for name in RATES:
        if getattr(ns, name) is not None:
            kw[name] = _above_0(ns, name)
    return Hardware(**{**vars(base), **kw})


def _above_0(ns, name: str):
    if getattr(ns, name) <= 0:
        raise BigfitError(f"--{name.replace('_', '-')} must be more than 0, got {getattr(ns, name)}")
    return getattr(ns, name)


def plan_command(ns) -> int:
    p, hw, fixed = compute_plan(ns)
    if ns.json:
        print(json.dumps(p.to_json(), indent=1))
    else:
        _show(Console(width=150), p, fixed)  # the table is wide; pipes would otherwise cut it at 80 columns
    if ns.plot:
        plot_plan(p, min(hw.gpu_bytes), ns.plot)
        if not ns.json:
            print(f"wrote {ns.plot}")
    return 0


def compute_plan(ns):
    """(the plan, the hardware, the degrees fixed by flags) of `bigfit plan`'s parsed arguments."""
    for name in POSITIVE:
        if getattr(ns, name) is not None:
            _above_0(ns, name)
    for name in AT_LEAST_0:
        if getattr(ns, name) is not None and getattr(ns, name) < 0:
            raise BigfitError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(ns, name)}")
    config = load_config(locate(ns.model))  # a bad --model is reported before any measuring
    if ns.calibrate:
        print(_calibrated(calibrate()))
    hw = hardware_from_args(ns)
    fixed = {d: getattr(ns, d) for d in DIMS if getattr(ns, d) is not None}  # the composed plans' degrees
    check_degrees(fixed, hw, *split_counts(config))
    lora, four_bit = lora_from_args(ns), getattr(ns, "load_in_4bit", False)
    if four_bit:  # train's refusals; the composed plans' degrees stand for its --strategy
        check_4bit(lora is not None, ns.precision, fixed)
    job = Job(batch_size=ns.batch_size, seq_len=ns.seq_len, target_len=ns.target_len if config.is_encoder_decoder
              else 0, micro_batch=ns.micro_batch_size, precision=ns.precision, checkpointing=ns.activation_checkpointing,
              chunks=ns.chunks, pipeline_schedule=ns.pipeline_schedule, stages_per_rank=ns.stages_per_rank,
              delayed_update=ns.delayed_update, offload_grads=ns.offload_grads, nvme_host_gb=ns.nvme_host_gb,
              sequence_parallel=ns.sequence_parallel, compile=ns.compile, lora=lora, load_in_4bit=four_bit,
              optimizer_states=planned_states(getattr(ns, "optimizer_states", "auto")))
    p = plan_for_config(config, hw, job, layouts=fixed)
    if fixed and not p.layouts and p.layout_rejected:  # the degrees asked for rule out every composed plan
        r = p.layout_rejected[0]
        raise BigfitError(f"{' '.join(f'--{flag(d)} {v}' for d, v in fixed.items())}: {r.group} ({r.name}: {r.detail})")
    return p, hw, fixed


def _calibrated(r: dict) -> str:
    """What --calibrate measured, and where it was kept (or why not: this plan uses it all the same)."""
    adam = ", ".join(f"{'torch fused' if f == 'torch' else f} {v / 1e9:.2f}" for f, v in r["host_adam"].items())
    kept = (f"not kept: {r['not_kept']}; this plan uses them, later ones can with --host-op-us {r['host_op_us']:.1f}"
            if r["not_kept"] else f"kept in {calibration_path()}")
    return (f"calibrated: the host issues a forward operator with its backward in {r['host_op_us']:.1f} us on "
            f"{r['device']} ({r['operators']} operators in {r['step_s'] * 1e3:.1f} ms); its Adam step takes G "
            f"parameters/s: {adam}; {kept}")


def lora_from_args(ns) -> LoraSettings | None:
    """The plan's LoRA settings (None: full fine-tuning), checked as `bigfit train` checks them. A
    namespace without the flags (a parser that lacks them) plans full fine-tuning."""
    given = {f: getattr(ns, f) for f in LORA_FLAGS if getattr(ns, f, None) is not None}
    return LoraSettings.checked(getattr(ns, "lora", False), given, "plan")


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
