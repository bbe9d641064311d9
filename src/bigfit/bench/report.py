"""`bigfit bench`'s results: the terminal table (the seed discussion's columns first: method, max
batch, train time, eval time; then the rest), OUTPUT/bench.md, bench.csv, bench.json and bench.png
(train and eval time per method, the max batch written on each bar). Pure: rows in, files out."""
from __future__ import annotations

import csv
import json
from pathlib import Path

# (key, header, format): the seed's columns first
COLUMNS = (("method", "method", "{}"), ("micro", "max BS", "{}"), ("train_s", "train s", "{:.2f}"),
           ("eval_s", "eval s", "{:.2f}"), ("score", "BLEU / ppl", "{}"), ("batch", "global batch", "{}"),
           ("step_s", "step s", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:,.0f}"), ("tflops", "TFLOP/s", "{:.2f}"),
           ("peak_gpu_gb", "peak GPU GB", "{:.2f}"), ("host_rss_gb", "host RSS GB", "{:.2f}"),
           ("predicted_micro", "predicted max BS", "{}"), ("predicted_peak_gb", "predicted GB", "{:.2f}"),
           ("predicted_step_s", "predicted step s", "{:.4f}"),
           ("predicted_train_s", "predicted train s at predicted max BS", "{:.2f}"), ("status", "status", "{}"))


# the terminal's columns (bench.md and bench.csv have them all)
TERMINAL = ("method", "micro", "train_s", "eval_s", "score", "step_s", "tokens_per_s", "peak_gpu_gb", "host_rss_gb",
            "predicted_micro", "predicted_step_s", "status")


def cells(row: dict) -> list[str]:
    """A row's cells as the table shows them: blank where it measured nothing."""
    out = []
    for key, _, fmt in COLUMNS:
        value = _score(row) if key == "score" else row.get(key)
        out.append("" if value is None or value == "" else fmt.format(value))
    return out


def _score(row: dict) -> str | None:
    if row.get("bleu") is not None:
        return f"BLEU {row['bleu']:.1f}"
    return f"ppl {row['ppl']:.2f}" if row.get("ppl") is not None else None


def recommendation(rows: list[dict], auto_pick: str | None) -> str:
    """The fastest measured method that ran, and whether `--strategy auto` picks it (planned, like
    the rows, at each method's largest micro-batch: job/autoplan.py _sized_pick)."""
    ran = [r for r in rows if r.get("train_s") is not None and r["status"] == "ok"]
    if not ran:
        return "no method ran to the end: nothing to recommend"
    best = min(ran, key=lambda r: r["train_s"])
    said = f"fastest measured: {best['method']} ({best['train_s']:.2f} s to train, micro-batch {best['micro']})"
    if auto_pick is not None:
        agrees = auto_pick == best["strategy"]
        said += (f"; --strategy auto picks it too ({auto_pick})" if agrees else
                 f"; --strategy auto would pick {auto_pick} instead")
    return said


def write(out: Path, rows: list[dict], meta: dict) -> list[Path]:
    """bench.md, bench.csv, bench.json and bench.png in `out`; returns the paths written."""
    headers = [h for _, h, _ in COLUMNS]
    table = [cells(r) for r in rows]
    md = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    md += ["| " + " | ".join(c.replace("|", "/") for c in t) + " |" for t in table]
    notes = [f"- {k}: {v}" for k, v in meta.items() if k != "rows"]
    why = [f"- {r['method']}: {r['status']}: {r['reason']}" for r in rows if r.get("reason")]
    (out / "bench.md").write_text("# bigfit bench\n\n" + "\n".join(notes) + "\n\n" + "\n".join(md) + "\n"
                                  + ("\n" + "\n".join(why) + "\n" if why else ""))
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([k for k, _, _ in COLUMNS if k != "score"] + ["bleu", "ppl", "reason"])
        for r in rows:
            w.writerow([r.get(k) for k, _, _ in COLUMNS if k != "score"] + [r.get("bleu"), r.get("ppl"), r.get("reason")])
    (out / "bench.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    paths = [out / n for n in ("bench.md", "bench.csv", "bench.json")]
    if plot(out / "bench.png", rows):
        paths.append(out / "bench.png")
    return paths


def plot(path: Path, rows: list[dict]) -> bool:
    """Bars of train and eval seconds per method, the max batch above each; False when none ran."""
    ran = [r for r in rows if r.get("train_s") is not None]
    if not ran:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(ran)), 4.2))
    xs = range(len(ran))
    train = [r["train_s"] for r in ran]
    evals = [r.get("eval_s") or 0.0 for r in ran]
    ax.bar([x - 0.2 for x in xs], train, width=0.4, label="train")
    ax.bar([x + 0.2 for x in xs], evals, width=0.4, label="eval (generate)")
    for x, r, t in zip(xs, ran, train):
        ax.annotate(f"BS {r['micro']}", (x - 0.2, t), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r["method"] for r in ran], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("bigfit bench: train and eval time per method (max micro-batch above each)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
