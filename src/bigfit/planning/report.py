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
    t.caption = ("per-GPU memory in GB (10^9 bytes; device_map: its fullest GPU, every device below); "
                 "host: one node's RAM for offloaded state")
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
    shown = _device_map_capacity(p)
    if shown is not None:  # device_map's bar is its fullest GPU, which need not be the smallest
        x = names.index("device_map")
        ax.hlines(shown[1] / 1e9, x - 0.45, x + 0.45, color="red", linestyle=":", label=f"{shown[0]} (device_map)")
    ax.set_ylabel("per-GPU memory (GB)")
    ax.set_title(f"bigfit plan: {p.hardware}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _device_map_capacity(p) -> tuple[str, int] | None:
    """(device, its memory) of the GPU the device_map row shows, when there is a map."""
    dm = p.device_map or {}
    if not dm.get("map") or "device_map" not in [c.estimate.name for c in p.candidates]:
        return None
    from .estimate import RESERVE

    budget = dm["devices"][dm["shown"]]["budget_bytes"]
    return dm["shown"], budget + (0 if dm["shown"].startswith("cpu") else RESERVE)  # budgets leave out the reserve
