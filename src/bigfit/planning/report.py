"""Showing a plan: a table for people, JSON for tools, a PNG of per-GPU memory against capacity."""
from __future__ import annotations

from rich.table import Table

from .estimate import KEYS


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def plan_table(p) -> Table:
    t = Table(title=f"bigfit plan: {p.hardware}", title_justify="left")
    short = {"params": "params", "grads": "grads", "optimizer": "optim", "activations": "activ", "buffers": "buffers"}
    for col in ("strategy", "fits", *(short[k] for k in KEYS), "GPU total", "host", "step s", "tok/s", "bound by"):
        t.add_column(col, justify="left" if col in ("strategy", "fits", "bound by") else "right")
    for c in p.candidates:
        e = c.estimate
        mark = "[green]yes[/green]" if c.fits else "[red]no[/red]"
        name = f"[bold]{e.name}[/bold]" if e.name == p.recommended else e.name
        t.add_row(name, mark, *(_gb(e.per_gpu[k]) for k in KEYS), _gb(e.per_gpu["total"]),
                  _gb(e.per_host["total"]), f"{e.step_time_s:.3f}", f"{c.tokens_per_s:,.0f}", e.bottleneck)
    t.caption = ("per-GPU memory in GB (10^9 bytes; device_map and pipeline: their fullest GPU, every device "
                 "below); host: one node's RAM for offloaded state")
    return t


def device_map_text(dm: dict | None) -> str:
    """The device map `auto` would choose, with each device's predicted peak against its budget."""
    if not dm:
        return ""
    if dm.get("map") is None:
        return f"[bold]device_map auto[/bold] (one process, every GPU and then host RAM): {dm['why_not']}"
    chunks = f", {dm['chunks']} GPipe chunks" if dm.get("chunks", 1) > 1 else ""
    return (f"[bold]device_map auto[/bold] (one process, every GPU and then host RAM{chunks}): {dm['describe']}\n"
            f"  predicted peak per device: {dm['text']}")


def pipeline_text(pl: dict | None) -> str:
    """The cut `--strategy pipeline` would make, with each rank's predicted bytes against its GPU."""
    if not pl or pl["stages"] == 1:  # not cut: the row's reason, under the table, says why
        return ""
    per = f", {pl['stages_per_rank']} per rank" if pl["stages_per_rank"] > 1 else ""
    return (f"[bold]pipeline[/bold] ({pl['schedule']}, {pl['stages']} stages{per}, {pl['chunks']} chunks per "
            f"micro-batch): {pl['describe']}\n  predicted per rank: {pl['text']}")


def plot_plan(p, gpu_capacity: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c.estimate.name for c in p.candidates]
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 4.5))
    bottom = [0.0] * len(names)
    for key in KEYS:
        vals = [c.estimate.per_gpu[key] / 1e9 for c in p.candidates]
        ax.bar(names, vals, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(gpu_capacity / 1e9, color="black", linestyle="--", label="smallest GPU")
    for name, (device, capacity) in _own_capacities(p).items():  # these bars are their fullest GPU, not the smallest
        x = names.index(name)
        ax.hlines(capacity / 1e9, x - 0.45, x + 0.45, color="red", linestyle=":", label=f"{device} ({name})")
    ax.set_ylabel("per-GPU memory (GB)")
    ax.set_title(f"bigfit plan: {p.hardware}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _own_capacities(p) -> dict[str, tuple[str, int]]:
    """Row -> (device, its memory) of the GPU the device_map and pipeline rows show (when there is a map)."""
    from .estimate import RESERVE

    out = {}
    for name, section in (("device_map", p.device_map), ("pipeline", p.pipeline)):
        if section and section.get("devices") and name in [c.estimate.name for c in p.candidates]:
            shown = section["shown"]
            budget = section["devices"][shown]["budget_bytes"]
            out[name] = shown, budget + (0 if shown.startswith("cpu") else RESERVE)  # budgets leave out the reserve
    return out
