"""The planner's predictions beside every H200 and H100 measurement (tests/data/h200_measured.json).

Each record is one measured case (benchmarks/RESULTS.md, benchmarks/results/*/): its model shape, strategy,
flags and batch. This script builds the config (transformers' LlamaConfig / GPT2Config / T5Config), describes
the H200 machine (141 GB per GPU, 125 GiB of host RAM, the rest bigfit.machine.hardware.DEFAULTS; an H100's memory and
rates from bigfit/machine/gpus.py where the record's machine is one) and plans the
record's strategy alone with `plan_for_config`, then prints the measured and predicted step time and peak
GPU bytes side by side. Peers (plain PyTorch, FSDP2, DeepSpeed) are rated as the closest bigfit strategy
(PEERS below) and shown as such. device_map rows are rated on the map that was measured (flat, split, tail),
with the same arithmetic as the plan's device_map row (planning/device_map_row.py), which would otherwise rate the
balancer's own map; the balancer's row is given as a note. Where several strategies were measured together
(a record's `group`), a second table puts the fastest measured beside the fastest predicted row and beside
what `--strategy auto` (plan_for_config over the strategies measured) picks.

  .venv/bin/python benchmarks/plan_vs_measured.py [--only ID,...] [--json OUT] [--data FILE] [--markdown PAGE]

CPU only, nothing is downloaded; the 3.6B-10.9B shapes trace under FakeTensorMode in seconds each.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from bigfit.machine.hardware import DEFAULTS, Hardware, gpu_rates, parse_gpus  # noqa: E402
from bigfit.planning.workload import Workload  # noqa: E402
from bigfit.planning.search import SPLIT_MARGIN, WHOLE, plan_for_config  # noqa: E402

DATA = ROOT / "tests" / "data" / "h200_measured.json"
GPU_BYTES = 141 * 10**9  # one H200
CPU_RAM = 125 * 2**30  # the single-GPU machine's host RAM (free -g)
# the bigfit strategy closest to each peer; DeepSpeed's CPU Adam steps after backward (no overlap), as
# the offload engine does with clipping on, so its offload row is rated with clipping
PEERS = {"plain-pytorch": ("single", {}), "fsdp2": ("zero3", {}), "fsdp2-cpu-offload": ("zero3-offload", {}),
         "deepspeed-zero2": ("zero2", {}), "deepspeed-zero3": ("zero3", {}),
         "deepspeed-zero2-offload": ("zero2-offload", {"clipping": True})}


def model_config(m: dict):
    if m["family"] == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=m["hidden"], num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                           num_key_value_heads=m["kv_heads"], intermediate_size=m["intermediate"],
                           vocab_size=m["vocab"], tie_word_embeddings=m["tied"], max_position_embeddings=8192,
                           use_cache=False)
    if m["family"] == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(n_embd=m["hidden"], n_layer=m["layers"], n_head=m["heads"], n_inner=m["intermediate"],
                          vocab_size=m["vocab"], n_positions=m["positions"], tie_word_embeddings=m["tied"])
    from transformers import T5Config  # as benchmarks/device_map.py builds it

    return T5Config(d_model=m["d_model"], d_ff=m["d_ff"], d_kv=m["d_kv"], num_heads=m["heads"],
                    num_layers=m["encoder_layers"], num_decoder_layers=m["decoder_layers"], vocab_size=m["vocab"],
                    tie_word_embeddings=m["tied"], dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                    eos_token_id=1, use_cache=False)


def strategy_of(r: dict) -> tuple[str, dict]:
    """The strategy to plan and any flags the mapping overrides (peers only)."""
    if r["peer"] is None:
        return r["strategy"], {}
    return PEERS[r["peer"]]


def hardware(r: dict) -> Hardware:
    f, extra = r["flags"], r.get("hardware") or {}
    # rows measured before bigfit's host Adam kernel (or with torch's / DeepSpeed's) move fp32 gradients
    kernel = f["host_adam"] in (None, "kernel")
    gpu = r["machine"].split()[0].split("-")[1]  # "nvidia-h200-x2 (GPU 0)": h200
    size, rates = (GPU_BYTES, {}) if gpu == "h200" else (parse_gpus(gpu)[0], gpu_rates(gpu))
    # the host's cost per operator where `--calibrate`'s measure ran on the same machine start (a host's
    # speed moves between starts: docs/planning.md), else the default that `bigfit plan` falls back to
    host_op_us = extra.get("host_op_us", DEFAULTS["host_op_us"])
    return Hardware(gpu_bytes=(size,) * r["batch"]["gpus"], cpu_ram=CPU_RAM, host_op_us=host_op_us,
                    cpu_adam_kernel=kernel, nvme=extra.get("nvme_bytes", 0),
                    nvme_gbps=extra.get("nvme_gbps", DEFAULTS["nvme_gbps"]), **rates)


def job(r: dict, strategy: str, override: dict) -> Workload:
    f, b = {**r["flags"], **override}, r["batch"]
    one_process = strategy in WHOLE  # device_map / pipeline: every stage reads the whole batch
    batch = b["micro_batch"] * b["accum"] * (1 if one_process else b["gpus"])
    return Workload(batch_size=batch, seq_len=b["seq_len"], target_len=b["target_len"], micro_batch=b["micro_batch"],
               precision=f["precision"], checkpointing=f["checkpointing"], delayed_update=f["delayed_update"],
               offload_grads=f["offload_grads"], nvme_host_gb=f["nvme_host_gb"] or 0.0, clipping=f["clipping"],
               chunks=f["chunks"], pipeline_schedule=f["pipeline_schedule"], compile=f["compile"],
               optimizer_states=f.get("optimizer_states") or "fp32")


def measured_map(prof, layout: dict, main: str = "cuda:0") -> list[str]:
    """The device of every block (the profile's stacks in forward order) in benchmarks/device_map.py's layouts,
    or "whole": every block on the main device (a map micro-batch auto balanced for a size the GPU holds)."""
    other = layout["devices"].split("+")[1]
    out = []
    for _, n in prof.stacks:
        encoder = not out
        if layout["layout"] == "flat":
            out += [main if encoder else other] * n
        elif layout["layout"] == "split":
            out += [main] * (n // 2) + [other] * (n - n // 2)
        elif layout["layout"] == "whole":
            out += [main] * n
        elif layout["layout"] == "tail":
            keep = n if encoder else n - layout["tail"]
            out += [main] * keep + [other] * (n - keep)
        else:
            raise ValueError(layout["layout"])
    return out


def rate_map(config, hw, jb, layout: dict) -> tuple[float, int, str]:
    """A measured device map rated as planning/device_map_row.py rates the balancer's: (step s, bytes of the fullest
    GPU, bottleneck)."""
    from bigfit.planning.automap import device_parts, profile_costs, profile_for
    from bigfit.planning import device_map_row as split

    prof, main = profile_for(config, jb), "cuda:0"
    assignment = measured_map(prof, layout, main)
    costs, stage = split.map_costs(prof, hw, jb, assignment, main)
    step = sum(costs.values())
    parts = device_parts(assignment, profile_costs(prof, jb), main, jb.chunks)
    gpu = max(sum(v.values()) for d, v in parts.items() if not d.startswith("cpu"))
    slowest = max(stage, key=stage.get)
    return step, gpu, f"{slowest} {stage[slowest]:.3f} s of {len(stage)} stages"


def predict(r: dict) -> dict:
    strategy, override = strategy_of(r)
    config, hw, jb = model_config(r["model"]), hardware(r), job(r, strategy, override)
    p = plan_for_config(config, hw, jb, strategies=(strategy,))
    c = p.candidates[0]
    e = c.estimate
    out = {"strategy": strategy, "step_s": e.step_time_s, "gpu_bytes": e.per_gpu["total"],
           "host_bytes": e.per_host["total"], "bottleneck": e.bottleneck, "fits": c.fits, "why_not": c.why_not,
           "costs": {k: round(v, 4) for k, v in e.costs.items()}, "rated": "plan row"}
    if strategy == "pipeline" and r.get("measured_rank") is not None:  # strategies.py's rank 0 reports its own peak
        out["gpu_bytes"] = p.pipeline["devices"][f"rank {r['measured_rank']}"]["predicted_bytes"]
    layout = r["flags"]["device_map"]
    if strategy == "device_map" and layout and layout["layout"] in ("flat", "split", "tail", "whole"):
        balancer = f"balancer's map: {e.step_time_s:.3f} s, {e.per_gpu['total'] / 1e9:.1f} GB"
        try:
            step, gpu, neck = rate_map(config, hw, jb, layout)
            out.update(step_s=step, gpu_bytes=gpu, bottleneck=neck, rated="measured map", why_not=balancer)
        except Exception as err:  # planning/device_map_row.py's helpers changed: keep the balancer's row
            out["why_not"] = f"{balancer}; measured map not rated ({type(err).__name__}: {err})"
    return out


def flags_text(r: dict) -> str:
    f, out = r["flags"], []
    out += ["ckpt"] * f["checkpointing"] + ["delayed"] * f["delayed_update"] + ["noclip"] * (not f["clipping"])
    if f["offload_grads"] != "host":
        out.append(f"grads:{f['offload_grads']}")
    if f["nvme_host_gb"]:
        out.append(f"nvme-host {f['nvme_host_gb']:g}GB")
    if f["pipeline_schedule"]:
        out.append(f["pipeline_schedule"])
    if f["chunks"]:
        out.append(f"chunks {f['chunks']}")
    if f["compile"]:
        out.append("compile")
    if f["device_map"]:
        d = f["device_map"]
        out.append(f"{d['layout']} {d['devices']}" + (" host-after" if d.get("host_beside") is False else ""))
    if f.get("optimizer_states") not in (None, "fp32"):
        out.append(f"states:{f['optimizer_states']}")
    if f["host_adam"] and f["host_adam"] != "kernel":
        out.append(f"adam:{f['host_adam']}")
    if op_us := (r.get("hardware") or {}).get("host_op_us"):
        out.append(f"host {op_us:.1f}us")  # calibrated on the same machine start
    return ",".join(out) or "-"


def model_text(m: dict) -> str:
    if m["family"] == "t5":
        return f"t5 {m['d_model']}/{m['encoder_layers']}+{m['decoder_layers']}/ff{m['d_ff']}"
    return f"{m['family']} {m['hidden']}x{m['layers']}" + (f" {m['params_b']}B" if m.get("params_b") else "")


def err(pred, meas) -> str:
    return f"{100 * (pred - meas) / meas:+.0f}" if pred is not None and meas else ""


def num(x, fmt: str) -> str:
    return format(x, fmt) if x is not None else ""


def row_of(r: dict, p: dict) -> dict:
    b = r["batch"]
    batch = f"{b['micro_batch']}x{b['seq_len']}" + (f"/{b['target_len']}" if b["target_len"] else "") + (
        f" acc{b['accum']}" if b["accum"] > 1 else "") + (f" {b['gpus']}gpu" if b["gpus"] > 1 else "")
    strategy = p["strategy"] if r["peer"] is None else f"peer {r['peer']} ~ {p['strategy']}"
    return {"id": r["id"], "group": r.get("group"), "model": model_text(r["model"]), "strategy": strategy,
            "flags": flags_text(r), "batch": batch, "measured_step_s": r["step_s"], "step_derived": r["step_derived"],
            "predicted_step_s": p["step_s"], "step_error_pct": None if r["step_s"] is None else
            round(100 * (p["step_s"] - r["step_s"]) / r["step_s"], 1),
            "measured_gpu_bytes": r["peak_gpu_bytes"], "predicted_gpu_bytes": p["gpu_bytes"],
            "gpu_error_pct": None if r["peak_gpu_bytes"] is None else
            round(100 * (p["gpu_bytes"] - r["peak_gpu_bytes"]) / r["peak_gpu_bytes"], 1),
            "bottleneck": p["bottleneck"], "fits": p["fits"], "why_not": p["why_not"], "rated": p["rated"],
            "costs": p["costs"], "superseded_by": r.get("superseded_by")}


def target_line(records: list[dict], rows: list[dict]) -> str:
    """How many of bigfit's current rows (peers and rows re-measured since, `superseded_by`, apart) are
    inside the target: step time within 20%, peak GPU memory within 10%."""
    by = {r["id"]: r for r in records}
    current = [w for w in rows if by[w["id"]]["peer"] is None and not by[w["id"]].get("superseded_by")]
    inside = [w for w in current if abs(w["step_error_pct"] or 0) <= 20 and abs(w["gpu_error_pct"] or 0) <= 10]
    old = sum(1 for w in rows if by[w["id"]].get("superseded_by"))
    return (f"{len(inside)} of {len(current)} current bigfit rows inside the target (step 20%, memory 10%); "
            f"{old} rows superseded by a re-measurement of the same case, not counted")


def print_table(rows: list[dict]) -> None:
    print("| id | model | strategy | flags | batch | measured s | predicted s | err % | measured GB | predicted GB"
          " | err % | predicted bottleneck |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for w in rows:
        meas = num(w["measured_step_s"], ".3f") + ("*" if w["step_derived"] else "")
        mg = w["measured_gpu_bytes"] and w["measured_gpu_bytes"] / 1e9
        name = w["id"] + (f" (since: {w['superseded_by']})" if w["superseded_by"] else "")
        print(f"| {name} | {w['model']} | {w['strategy']} | {w['flags']} | {w['batch']} | {meas} | "
              f"{w['predicted_step_s']:.3f} | {err(w['predicted_step_s'], w['measured_step_s'])} | {num(mg, '.1f')} | "
              f"{w['predicted_gpu_bytes'] / 1e9:.1f} | {err(w['predicted_gpu_bytes'], w['measured_gpu_bytes'])} | "
              f"{w['bottleneck']}" + (" (measured map)" if w["rated"] == "measured map" else "") + " |")


def auto_pick(records: list[dict]) -> str:
    """`--strategy auto` over the group's measured strategies, planned for its first bigfit row's job on the
    most GPUs the group used (device_map / pipeline with the job's whole batch, as planned)."""
    strategies = tuple(dict.fromkeys(strategy_of(r)[0] for r in records))
    if len(strategies) < 2:
        return "(one strategy)"
    base = max(records, key=lambda r: r["batch"]["gpus"])
    hw = hardware(base)
    first = next(r for r in records if r["strategy"] not in WHOLE) if any(
        r["strategy"] not in WHOLE for r in records) else base
    jb = job(first, first["strategy"], {})
    if base["batch"]["gpus"] > first["batch"]["gpus"]:  # data-parallel row of one GPU beside a 2-GPU split
        jb = replace(jb, batch_size=first["batch"]["micro_batch"])
    jb = replace(jb, micro_batch=None, chunks=None, pipeline_schedule=None)
    if hw.world_size > 1 and "single" in strategies:
        strategies = tuple(s for s in strategies if s != "single") + ("ddp",)
    p = plan_for_config(model_config(base["model"]), hw, jb, strategies=strategies)
    return f"{p.recommended or 'none'}" + (f" ({', '.join(strategies)})")


def print_groups(records: list[dict], rows: list[dict]) -> list[dict]:
    by_id = {w["id"]: w for w in rows}
    groups = {}
    for r in records:
        if r.get("group") and r["step_s"] is not None and r["id"] in by_id:
            groups.setdefault(r["group"], []).append(r)
    out = []
    print("\n| group | rows | fastest measured | fastest predicted row | auto over the strategies measured |")
    print("| --- | --- | --- | --- | --- |")
    for g, rs in groups.items():
        if len(rs) < 2:
            continue
        fast = min(rs, key=lambda r: r["step_s"])

        def ranked(r):  # as search._rank: device_map and pipeline must win by SPLIT_MARGIN
            w = by_id[r["id"]]
            return w["predicted_step_s"] * (SPLIT_MARGIN if strategy_of(r)[0] in WHOLE else 1.0)

        fitting = [r for r in rs if by_id[r["id"]]["fits"]] or rs
        pred = min(fitting, key=ranked)
        try:
            auto = auto_pick(rs)
        except Exception as e:  # a group the planner cannot rate together
            auto = f"not rated ({type(e).__name__}: {e})"
        print(f"| {g} | {len(rs)} | {fast['id']} ({fast['step_s']:.3f} s) | {pred['id']} "
              f"({by_id[pred['id']]['predicted_step_s']:.3f} s) | {auto} |")
        out.append({"group": g, "rows": [r["id"] for r in rs], "fastest_measured": fast["id"],
                    "fastest_predicted": pred["id"], "auto": auto})
    return out


DOC_HEAD = """# The planner against every H200 and H100 measurement

Written by `python benchmarks/plan_vs_measured.py --markdown docs/plan_accuracy.md` ({date}): every case in
tests/data/h200_measured.json (its command, machine and raw output named there) with the planner's
prediction beside it. Target: step time within 20%, peak GPU memory within 10%; tests/test_plan_accuracy.py
holds the rows inside it (and checks that this page shows their current predictions); docs/planning.md
("Accuracy, measured") says why the rows outside it are.

"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--only", help="comma-separated record ids")
    ap.add_argument("--json", help="write the rows (and the groups) here")
    ap.add_argument("--markdown", help="write the tables and the summary to this page too (docs/plan_accuracy.md)")
    a = ap.parse_args()
    if not a.markdown:
        return report(a)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        report(a)
    text = shown.getvalue()
    print(text, end="")
    kept = [line for line in text.splitlines() if "records rated in" not in line]  # the page changes with the model only
    Path(a.markdown).write_text(DOC_HEAD.format(date=time.strftime("%Y-%m-%d")) + "\n".join(kept) + "\n")


def report(a) -> None:
    t0 = time.perf_counter()
    records = json.loads(Path(a.data).read_text())
    if a.only:
        want = set(a.only.split(","))
        unknown = want - {r["id"] for r in records}
        if unknown:
            raise SystemExit(f"--only: no record {', '.join(sorted(unknown))}")
        records = [r for r in records if r["id"] in want]
    rows, failed = [], []
    for r in records:
        try:
            rows.append(row_of(r, predict(r)))
        except Exception as e:  # one record the planner cannot rate must not hide the others
            failed.append((r["id"], f"{type(e).__name__}: {e}"))
    print_table(rows)
    print("\n* derived: step time from tokens per step / tokens/s (the record's step_derived says how)")
    groups = print_groups(records, rows)
    for rid, why in failed:
        print(f"not rated: {rid}: {why}")
    timed = [w for w in rows if w["step_error_pct"] is not None]
    worst = sorted(timed, key=lambda w: -abs(w["step_error_pct"]))[:5]
    print("\nlargest step-time errors: " + "; ".join(f"{w['id']} {w['step_error_pct']:+.0f}%" for w in worst))
    print(f"step error |median| {sorted(abs(w['step_error_pct']) for w in timed)[len(timed) // 2]:.0f}% over "
          f"{len(timed)} rows; " + ", ".join(f"{k}: {v}" for k, v in Counter(w['rated'] for w in rows).items()))
    print(target_line(records, rows))
    print(f"{len(rows)} records rated in {time.perf_counter() - t0:.1f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "groups": groups, "failed": failed}, indent=1))


if __name__ == "__main__":
    main()
