"""`bigfit plan`: describe the model (meta/fake, no weights) and the hardware, plan, show."""
from __future__ import annotations

import json

from ..errors import BigfitError
from ..hardware import Hardware, detect, host_ram, parse_gpus, parse_size
from ..models import load_config, locate
from .search import Job, plan_for_config


def hardware_from_args(ns) -> Hardware:
    if ns.gpus:
        base = Hardware(gpu_bytes=tuple(parse_gpus(ns.gpus)), cpu_ram=host_ram())
    else:
        base = detect()
    kw = {"nodes": ns.nodes, "nvme": parse_size(ns.nvme, "--nvme")}
    if ns.cpu_ram:
        kw["cpu_ram"] = parse_size(ns.cpu_ram, "--cpu-ram")
    for name in ("pcie_gbps", "intra_gbps", "inter_gbps"):
        if getattr(ns, name):
            kw[name] = getattr(ns, name)
    return Hardware(**{**vars(base), **kw})


def plan_command(ns) -> int:
    from rich.console import Console

    for name in ("batch_size", "seq_len"):
        if getattr(ns, name) <= 0:
            raise BigfitError(f"--{name.replace('_', '-')} must be positive, got {getattr(ns, name)}")
    hw = hardware_from_args(ns)
    config = load_config(locate(ns.model))
    job = Job(batch_size=ns.batch_size, seq_len=ns.seq_len, target_len=ns.target_len if config.is_encoder_decoder
              else 0, micro_batch=ns.micro_batch_size, precision=ns.precision, checkpointing=ns.activation_checkpointing)
    p = plan_for_config(config, hw, job)
    if ns.json:
        print(json.dumps(p.to_json(), indent=1))
    else:
        from .report import plan_table

        console = Console(width=150)  # the table is wide; pipes would otherwise cut it at 80 columns
        console.print(plan_table(p))
        for c in p.candidates:
            if not c.fits:
                console.print(f"  {c.estimate.name}: {c.why_not}")
        console.print(f"[bold]recommended[/bold]: {p.recommended or 'none'}: {p.reason}")
        for note in p.notes:
            console.print(f"  {note}")
    if ns.plot:
        from .report import plot_plan

        plot_plan(p, min(hw.gpu_bytes), ns.plot)
        if not ns.json:
            print(f"wrote {ns.plot}")
    return 0


def auto_strategy(cfg, world: int) -> tuple[str, str]:
    """`--strategy auto`: plan for this machine (its GPUs, or on a CPU-only machine its RAM split over
    the processes) and return the recommendation and why."""
    import torch

    from ..config import auto_precision

    hw = detect() if torch.cuda.is_available() else Hardware(gpu_bytes=(host_ram() // world,) * world)
    hw = Hardware(**{**vars(hw), "gpu_bytes": hw.gpu_bytes[:world]})
    config = load_config(locate(cfg.model))
    job = Job(batch_size=cfg.batch_size, seq_len=cfg.max_source_len,
              target_len=cfg.max_target_len if config.is_encoder_decoder else 0, micro_batch=cfg.micro_batch_size,
              precision=cfg.precision or auto_precision(), checkpointing=cfg.activation_checkpointing)
    p = plan_for_config(config, hw, job)
    if p.recommended is None:
        raise BigfitError(f"--strategy auto: {p.reason}")
    return p.recommended, p.reason
