"""LoRA under tensor parallelism (tensor/adapters.py: each adapter split to match its base layer)
against single-process LoRA through the real training loop, fp32, 3 steps: TP 2 on T5, GPT-2 (the
fused c_attn's adapter moved to the heads layout) and Llama on 2 gloo ranks, and FSDP2 x TP
(dp_shard 2 x tp 2) on Llama on 4. Equal losses each step and equal adapters after the last step
(gathered by the checkpoint). Which style each adapter gets, per family, from the plan alone."""
from __future__ import annotations

import pytest

from conftest import FAMILIES, read_jsonl
from dist import run_ranks, threads_per_rank, torch_threads
from test_adapters_lora import LOSS_TOL, PARAM_TOL, final_state, job

LAYOUTS = {"tp2": ("ddp", 2, FAMILIES), "fsdp-tp": ("zero3", 4, ("llama",))}


def _run(model_dirs, data, root, layout: str) -> None:
    from dist import train

    strategy, _, families = LAYOUTS[layout]
    for family in families:
        train(job(model_dirs[family], data, root / f"{family}-{layout}", strategy, tp=2))


@pytest.fixture(scope="module")
def runs(model_dirs, pairs_file, tmp_path_factory):
    from dist import train

    root = tmp_path_factory.mktemp("lora-tp")

    def references():
        with torch_threads(threads_per_rank(2)):
            for family in FAMILIES:
                train(job(model_dirs[family], pairs_file, root / f"{family}-single", "single"))

    run_ranks(_run, 2, model_dirs, pairs_file, root, "tp2", meanwhile=references)
    run_ranks(_run, 4, model_dirs, pairs_file, root, "fsdp-tp")
    return root


@pytest.mark.parametrize("family,layout", [(f, "tp2") for f in FAMILIES] + [("llama", "fsdp-tp")])
def test_lora_under_tensor_parallel_matches_single_process(runs, family, layout):
    ref, got = runs / f"{family}-single", runs / f"{family}-{layout}"
    ref_losses = [r["loss"] for r in read_jsonl(ref / "metrics.jsonl")]
    got_losses = [r["loss"] for r in read_jsonl(got / "metrics.jsonl")]
    a, b = final_state(ref)["model"], final_state(got)["model"]
    assert set(a) == set(b) and all(".lora_" in k for k in a)  # the adapters alone, whole
    loss_diff = max(abs(x - y) / x for x, y in zip(ref_losses, got_losses))
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"{family} lora {layout}: max loss rel diff {loss_diff:.1e}, max adapter diff {worst:.1e}")
    assert len(got_losses) == 3 and loss_diff <= LOSS_TOL, f"losses {got_losses} vs {ref_losses}"
    assert worst <= PARAM_TOL, f"largest adapter difference {worst:.2e}"
    assert any(b[k].abs().max() > 0 for k in b if ".lora_B." in k)  # B starts at zero: it moved


@pytest.mark.parametrize("family", FAMILIES)
def test_each_adapter_is_split_like_its_base_layer(model_dirs, family):
    """Column-parallel base: lora_B column-parallel (GPT-2's fused c_attn: to the heads layout), lora_A
    replicated; row-parallel base: lora_A row-parallel, lora_B replicated. No mesh needed: the plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from bigfit.settings.config import TrainConfig
    from bigfit.adapters.lora import LoraSettings, inject
    from bigfit.models.source import build_model, load_config, locate
    from bigfit.tensor import plans
    from bigfit.tensor.adapters import FusedLinearColwise, with_adapters
    from bigfit.tensor.styles import Conv1DColwise, Conv1DRowwise, FusedConv1DColwise

    src = locate(str(model_dirs[family]))
    model = build_model(src, load_config(src), 0, on_meta=True)
    inject(model, LoraSettings.from_config(TrainConfig(lora=True, lora_r=4, lora_alpha=8.0, lora_dropout=0.0)))
    styles = with_adapters(model, plans.build(model).styles)
    pairs = {"colwise": (ColwiseParallel, Conv1DColwise, FusedConv1DColwise), "rowwise": (RowwiseParallel, Conv1DRowwise)}
    bases = {n[: -len(".base_layer")]: s for n, s in styles.items() if n.endswith(".base_layer")}
    assert bases and not any(".base_layer" not in n and ".lora_" not in n and n in bases for n in styles)
    for name, base in bases.items():
        a, b = styles.get(f"{name}.lora_A.default"), styles.get(f"{name}.lora_B.default")
        if isinstance(base, FusedConv1DColwise):
            assert a is None and isinstance(b, FusedLinearColwise) and (b.parts, b.width) == (base.parts, base.width)
        elif isinstance(base, pairs["colwise"]):
            assert a is None and isinstance(b, ColwiseParallel), name
        else:
            assert isinstance(base, pairs["rowwise"]) and isinstance(a, RowwiseParallel) and b is None, name
