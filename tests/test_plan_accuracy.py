"""The planner against every case measured on the H200 machine (tests/data/h200_measured.json, rated
by benchmarks/plan_vs_measured.py, the same code `bigfit plan` runs): the rows inside the target
(step time within 20%, peak GPU memory within 10%) must stay inside it, so a change that breaks the
model's accuracy fails here. docs/planning.md's accuracy table lists every row with its error; the
rows outside the target are named there with why (T5 at small batches, bound by a host whose speed
varied between machine starts; rows made by code since changed, each with its re-measurement in
`superseded_by`, not held). QLoRA's rows (`--lora --load-in-4bit`) are held from their own table
below, with the rows outside the target named in KNOWN_MISSES by their measured error."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
STEP, MEMORY = 0.20, 0.10
HELD = """s1-single s1-zero2 s1-zero3 s1-zero3-offload x2-single x2-zero2-offload pa2-single-gpt2-x2 pa2-single-gpt2-x8
pa2-zero2-gpt2-x2 pa2-zero2-gpt2-x8 pa2-zero3-gpt2-x2 pa2-single-llama-x2 pa2-single-llama-x8 pa2-zero2-llama-x2
pa2-zero2-llama-x8 pa3-zero3-llama-x2 pa3-zero3-llama-x8 pa3-zero3-gpt2-x8 pa3-zero2-offload-llama-x2
pa3-zero2-offload-llama-x8 pa3-zero2-offload-gpt2-x2 pa3-zero2-offload-gpt2-x8 x4c1-single x4c1-zero2-offload-eager
x4c4-zero2-offload-delayed x4c1-acc4-delayed x4c1-acc4-eager x4c1-acc4-zero2-offload sc-ddp-1gpu sc-zero1-1gpu
sc-zero2-1gpu sc-zero3-1gpu sc-ddp-2gpu sc-zero1-2gpu sc-zero2-2gpu sc-zero3-2gpu dm4-t5l-cpu-b8-unsplit
dm6-b8-unsplit x2a-acc4-delayed pp2-gpipe-m8 pp2-1f1b-m4 pp2-1f1b-m8 pp2-zero3-m8 k2-delayed k3-delayed
k3-zero2-offload k5-delayed k2-acc4-delayed k2-zero3-offload-eager k2-zero3-offload 8b-zero2 8b-zero3 p6-delayed
p6-delayed-torchpinned ss1-single ss1-zero2 ss1-zero3 ss1-zero2-offload ss1-zero3-offload ss1-device_map
ss2-zero2-offload ss2-single ss3-single ss3-zero3 ss3-zero2-offload ss3-zero3-offload dm2-t5l-cpu-split-c4
dm4-t5l-cpu-b8-split-c4 pp2-zero3-m4 dm2-t5l-2gpu-unsplit dm4-t53-2gpu-b8-flat-c4 dm4-t53-2gpu-b8-split-c4
dm4-t5l-2gpu-b32-unsplit dm4-t5l-2gpu-b32-flat dm6-b64-unsplit dm6-b64-tail-c2 dm6-b64-tail-c2-after dm6-b64-tail-c4
dm6-b64-tail-c4-after dm6-b128-unsplit dm6c4-b64-unsplit dm6c4-b64-tail-c2 dm6c4-b128-unsplit-compiled
dm2-t5l-2gpu-flat dm4-t5l-2gpu-b32-flat-c4 dm4-t5l-2gpu-b32-split-c4 dm6-b128-tail-c4 dm6-b128-tail-c4-after
dm6c4-b64-tail-c2-compiled pp2-interleaved-m4 pp2-interleaved-m8 pack-1b-single-8x2048 nvme-10.9b-steps10-19
dm2-t5l-cpu-flat dm2-t5l-cpu-split dm3-t5l-cpu-b8-flat dm3-t5l-cpu-b8-split-c4 dm4-t5l-cpu-b8-flat
dm4-t5l-cpu-b8-split dm4-t5l-cpu-b8-flat-c4 dm6-b64-tail dm6-b128-tail dm6-b128-tail-c2 dm6-b128-tail-c2-after
dm6-b8-flat dm6-b8-flat-c4 dm6-b8-flat-c4-after dm6c4-b64-tail dm6c4-b64-unsplit-compiled dm6c4-b64-tail-compiled
dm6c4-b64-tail-c2-after-compiled dm6c4-b128-tail-compiled pp2-gpipe-m4 o4-3b-clip o4-3b-eager o4-3b-delayed
o4-3b-devgrads o4-3b-delayed-devgrads o4-3b-torchadam o4-3b-delayed-torchadam o4-1b-clip o4-1b-torchadam dm7-b16-flat
dm7-b16-split dm7-b16-flat-c2 dm7-b16-split-c2 dm8-b64-unsplit-compiled dm8-b64-tail-compiled o4-3b-torchadam-eager
o4-3b-torchadam-devgrads o4-3b-delayed-torchadam-devgrads os-10.9b-bf16-clip os-10.9b-bf16-eager os-10.9b-bf16-delayed
cve5-zero3-0 cve5-zero2-1 cve5-zero3-offload-2 cve5-zero3-3 bench5-single bench5-zero2 bench5-zero3
bench5-zero3-offload nvme-21.9b-int8 nvme-25.0b-int8 bench6-zero2-offload bench6-single-fp32 h100-bench-single h100-bench-zero3
dm7-b16-unsplit dm9-b8-unsplit dm9-b8-split dm9-b8-split-c4 dm9-b16-unsplit h100c-bench-zero2 h100d-train-zero2-offload-160
h100d-train-zero2-offload-128 h100d-train-zero2-128 h100e-bench-zero2-offload h100e-bench-zero2
h100e-bench-zero3-offload h100e-bench-single h100e-bench-zero2-offload-b h100e-bench-zero3 h100f-bench-device_map
h100f-bench-single-fp32 h100f-bench-single h100f-bench-zero2 h100f-bench-zero3 h100f-bench-zero2-offload
h100f-bench-zero3-offload cve6-ddp-1 cve6-zero1-2 cve6-device_map-3 cve6-ddp-4 cve6-zero1-5
cve6-device_map-6 dm10-b96-tail dm10-b96-tail-c2 dm10-b96-tail-c2-after dm10-b96-tail-c4 dm10-b96-tail-c4-after
dm10-b64-unsplit dm10-b64-tail dm10-b64-tail-c2 dm10-b64-tail-c4 dm10-b64-tail-c4-after dm10-b64-tail-compiled
dm10-b64-tail-c2-compiled dm10-b64-tail-c2-after-compiled dm10-b8-flat dm10-b8-flat-c4 dm10-b8-flat-c4-after
cve7-zero3-0 cve7-zero3-1 cve7-zero3-2 h100-nvme-10.9b-host111""".split()


@pytest.fixture(scope="module")
def rated() -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_vs_measured

    records = {r["id"]: r for r in json.loads((ROOT / "tests" / "data" / "h200_measured.json").read_text())}
    return {i: (records[i], plan_vs_measured.predict(records[i])) for i in HELD}


@pytest.mark.parametrize("case", HELD)
def test_prediction_within_target(rated, case):
    record, predicted = rated[case]
    step, gpu = record["step_s"], record["peak_gpu_bytes"]
    assert step or gpu
    if step:
        assert predicted["step_s"] == pytest.approx(step, rel=STEP), predicted["costs"]
    if gpu:
        assert predicted["gpu_bytes"] == pytest.approx(gpu, rel=MEMORY)


# QLoRA on one H200 (benchmarks/RESULTS.md, 2026-12-02 night; benchmarks/results/2026-12-02-h200-qlora/
# call3.sh, call4.sh): bigfit train --lora --load-in-4bit --strategy single --precision bf16, all-linear
# r 16, config-only Llama shapes (8 KV heads, vocabulary 128256, untied), 2048 tokens a sample. The step
# is the median of steps 2-5 (tokens a step over tok/s: 8188 and 2047 label tokens), the peak
# torch.cuda.max_memory_allocated. Not in h200_measured.json, whose records carry no LoRA settings.
QLORA = {  # id: (hidden, layers, heads, intermediate, samples, checkpointing, step s, peak GPU bytes)
    "qlora-8b": (4096, 32, 32, 14336, 4, False, 8188 / 10287.4, 86.06e9),
    "qlora-70b": (8192, 80, 64, 28672, 1, True, 2047 / 927.78, 50.91e9),
    "qlora-165b": (12288, 88, 96, 40960, 1, True, 2047 / 443.95, 106.87e9),
}
# Outside the target, with the prediction's measured error (predicted / measured - 1), held to within
# MISS_DRIFT so that a change moving one must say so here: none since LoRA's memory-bound operators are
# rated at the efficiency the H200's profiler read for them (devicecost.LORA_MEM_EFFICIENCY; the 8B step
# read +26% before).
KNOWN_MISSES: dict[str, dict[str, float]] = {}
MISS_DRIFT = 0.03


@pytest.fixture(scope="module")
def qlora_rated() -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_vs_measured import CPU_RAM, GPU_BYTES, model_config

    from bigfit.machine.hardware import DEFAULTS, Hardware
    from bigfit.adapters.lora import LoraSettings
    from bigfit.planning.workload import Workload
    from bigfit.planning.search import plan_for_config

    hw = Hardware(gpu_bytes=(GPU_BYTES,), cpu_ram=CPU_RAM, host_op_us=DEFAULTS["host_op_us"])
    out = {}
    for case, (hidden, layers, heads, inter, samples, ckpt, _, _) in QLORA.items():
        config = model_config(dict(family="llama", hidden=hidden, layers=layers, heads=heads, kv_heads=8,
                                   intermediate=inter, vocab=128256, tied=False))
        job = Workload(batch_size=samples, seq_len=2048, precision="bf16", checkpointing=ckpt, lora=LoraSettings(),
                  load_in_4bit=True)
        out[case] = plan_for_config(config, hw, job, strategies=("single",)).candidates[0].estimate
    return out


@pytest.mark.parametrize("case", QLORA)
def test_qlora_prediction_within_target_or_its_known_miss(qlora_rated, case):
    e, (*_, step, gpu) = qlora_rated[case], QLORA[case]
    errors = {"step": e.step_time_s / step - 1, "memory": e.per_gpu["total"] / gpu - 1}
    print(f"{case}: step {e.step_time_s:.3f} s against {step:.3f}, peak {e.per_gpu['total'] / 1e9:.1f} GB against "
          f"{gpu / 1e9:.1f}; errors {errors}")
    for kind, target in (("step", STEP), ("memory", MEMORY)):
        miss = KNOWN_MISSES.get(case, {}).get(kind)
        if miss is None:
            assert abs(errors[kind]) <= target, (kind, errors, e.costs)
        else:
            assert errors[kind] == pytest.approx(miss, abs=MISS_DRIFT), (kind, errors, e.costs)


def test_the_accuracy_page_shows_every_case_and_the_current_predictions(rated):
    """docs/plan_accuracy.md (benchmarks/plan_vs_measured.py --markdown) lists every record, and its
    predictions of the held rows are today's: a change to the planner rewrites the page."""
    page = (ROOT / "docs" / "plan_accuracy.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 12 and cells[0] not in ("id", "---"):
            rows[cells[0].split(" (since:")[0]] = cells
    records = json.loads((ROOT / "tests" / "data" / "h200_measured.json").read_text())
    assert set(rows) == {r["id"] for r in records}
    rewrite = "python benchmarks/plan_vs_measured.py --markdown docs/plan_accuracy.md"
    for case, (_, predicted) in rated.items():
        shown = (rows[case][6], rows[case][9])
        assert shown == (f"{predicted['step_s']:.3f}", f"{predicted['gpu_bytes'] / 1e9:.1f}"), (case, rewrite)
