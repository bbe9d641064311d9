"""Showing a plan: a table for people, JSON for tools, a PNG of per-GPU memory against capacity."""
from __future__ import annotations

from rich.table import Table

from .estimate import CACHE_SLACK, KEYS, RESERVE
from .keeping import keeping_text


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


SHORT = {"params": "params", "grads": "grads", "optimizer": "optim", "activations": "activ", "buffers": "buffers"}


def _table(title: str, first: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in (first, "fits", *(SHORT[k] for k in KEYS), "GPU total", "host", "step s", "tok/s", "bound by"):
        t.add_column(col, justify="left" if col in (first, "fits", "bound by") else "right")
    return t


def _add(t: Table, c, bold: bool) -> None:
    e = c.estimate
    mark = "[green]yes[/green]" if c.fits else "[red]no[/red]"
    # --optimizer-states auto's choice, and how the row keeps its activations (--activations auto's choice)
    said = [f"{e.states} states"] * (e.states != "fp32") + [keeping_text(e)] * bool(keeping_text(e))
    # a composed plan's name ends in its kind's brackets: the words join them
    name = e.name if not said else (f"{e.name[:-1]}, {', '.join(said)})" if e.name.endswith(")")
                                     else f"{e.name} ({', '.join(said)})")
    t.add_row(f"[bold]{name}[/bold]" if bold else name, mark, *(_gb(e.per_gpu[k]) for k in KEYS),
              _gb(e.per_gpu["total"]), _gb(e.per_host["total"]), f"{e.step_time_s:.3f}", f"{c.tokens_per_s:,.0f}",
              e.bottleneck)


def plan_table(p) -> Table:
    t = _table(f"bigfit plan: {p.hardware}", "strategy")
    for c in p.candidates:
        _add(t, c, c.estimate.name == p.recommended)
    t.caption = ("per-GPU memory in GB (10^9 bytes; device_map and pipeline: their fullest GPU, every device "
                 "below); host: one node's RAM for offloaded state; beside a name: activations checkpointed "
                 "(the first N blocks of each stack) or offloaded to host RAM where the row needs it")
    if p.job.lora:  # gradients and optimizer states are the adapters': say how many parameters those are
        t.caption += (f"; LoRA: {p.trainable_params / 1e6:,.2f}M of {p.params / 1e6:,.1f}M parameters train "
                      "(grads and optim are theirs)")
    return t


def longest_table(named: list, composed: list, hardware: str, micro: int, shown: int) -> Table:
    """`bigfit plan --max-seq-len`: each row's longest sequence (longest.py) with its bytes and time there,
    the named rows, then the `shown` composed plans that reach furthest."""
    t = Table(title=f"bigfit plan --max-seq-len: {hardware}", title_justify="left")
    cols = ("strategy", "tokens", "activations", "GPU total", "host", "step s", "tok/s", "bound by", "longer: out of")
    for col in cols:
        t.add_column(col, justify="right" if col in ("tokens", "GPU total", "host", "step s", "tok/s") else "left")
    for r in [*named, *[c for c in composed if c.tokens][:shown]]:
        e = r.row.estimate if r.row else None
        if r.tokens is None or e is None:  # why not even the shortest fits: under the table
            t.add_row(r.name, "none", *[""] * 6, _limit(r.beyond))
            continue
        name = r.name + (f" ({e.states} states)" if e.states != "fp32" else "")  # --optimizer-states auto's choice
        t.add_row(name, f"{r.tokens:,}", keeping_text(e) or "keep", _gb(e.per_gpu["total"]), _gb(e.per_host["total"]),
                  f"{e.step_time_s:.3f}", f"{r.row.tokens_per_s:,.0f}", e.bottleneck, _limit(r.beyond))
    t.caption = (f"the longest sequence a sample predicted to fit at micro-batch {micro} per process, with "
                 f"{CACHE_SLACK:.0%} of each GPU left to the allocator's cache; memory in GB at that length (10^9 bytes)")
    return t


def _limit(beyond: str) -> str:
    """What a row runs out of one step longer (longest.Longest.beyond), in a word or two."""
    if not beyond or "longest searched" in beyond:
        return beyond and "nothing (searched no further)"
    return "host RAM" if "host RAM" in beyond else "NVMe" if "NVMe" in beyond else "GPU memory"


def longest_notes(rows: list) -> list[str]:
    """Why the rows that hold no length at all do not: one line each."""
    return [f"  {r.name}: {r.beyond}" for r in rows if r.tokens is None]


def layout_table(p, shown: int, restricted: str = "") -> Table | None:
    """The fastest composed plans that fit (layouts.py), `shown` of them; None when none fits."""
    fit = [c for c in p.layouts or () if c.fits][:shown]
    if not fit:
        return None
    t = _table(f"composed plans{restricted}: the {len(fit)} fastest that fit", "plan")
    for c in fit:
        _add(t, c, c is p.layout_pick)
    t.caption = ("per-GPU memory of the fullest rank in GB; degrees in mesh order: pp x dp_replicate x dp_shard x cp "
                 "x tp")
    return t


def rejected_text(p) -> list[str]:
    """Why the other composed plans are not listed: one line per reason, with how many, a few of their
    names and, for one of them, the line that says it."""
    lines = []
    over = sorted((c for c in p.layouts or () if not c.fits), key=lambda c: c.estimate.per_gpu["total"])
    if over:
        closest = over[0]
        lines.append(f"  does not fit: {_names([c.estimate.name for c in over])}; the closest, "
                     f"{closest.estimate.name}, {closest.why_not}")
    groups: dict[str, list] = {}
    for r in p.layout_rejected:
        groups.setdefault(r.group, []).append(r)
    for why, items in groups.items():
        lines.append(f"  {why}: {_names([r.name for r in items])} ({items[0].name}: {items[0].detail})")
    return lines


def _names(names: list[str], first: int = 4) -> str:
    return ", ".join(names[:first]) + (f", ... ({len(names)} in all)" if len(names) > first else "")


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
    out = {}
    for name, section in (("device_map", p.device_map), ("pipeline", p.pipeline)):
        if section and section.get("devices") and name in [c.estimate.name for c in p.candidates]:
            shown = section["shown"]
            budget = section["devices"][shown]["budget_bytes"]
            out[name] = shown, budget + (0 if shown.startswith("cpu") else RESERVE)  # budgets leave out the reserve
    return out
