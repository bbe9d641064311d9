"""LoRA (peft adapters on a frozen base, bigfit/adapters/lora.py) under every strategy against single-process
LoRA, through the real training loop on T5 (tied embeddings, unequal depth), GPT-2 (Conv1D) and a
Llama-style model, fp32: equal losses each step and equal adapters after 3 steps (2 gloo ranks:
ddp, zero1, zero2, zero3, zero2-offload, zero3-offload, a 2-stage pipeline; one process: a device
map in 2 chunks); checkpoints hold the adapters and their optimizer states alone, under every
strategy (the base is made again from its source on every start), `consolidate --merge` makes the
seeded base again bit for bit, and a run resumed from them continues exactly (single, zero1, zero3,
zero2-offload, pipeline); the disk check counts the adapters peft adds; bad settings are one line each.

Tolerances: about 10x the worst difference measured on torch 2.13, CPU (printed with -s).
"""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import FAMILIES, read_jsonl
from dist import run_ranks, threads_per_rank, torch_threads

DISTRIBUTED = ("ddp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "pipeline")
LOSS_TOL, PARAM_TOL = 1e-6, 1e-5  # worst seen: 6.7e-8 (llama device_map), 6.3e-7 (llama pipeline)
# runs saved at step 2 too and continued from there (the family each strategy resumes): each engine's own
# checkpoint_state / after_load (base.py, ZeRO-1's, the offload engine's, pipeline stages')
RESUMED = {"single": "gpt2", "zero1": "llama", "zero3": "llama", "zero2-offload": "llama", "pipeline": "t5"}


def job(model_dir, data, out, strategy: str, **kw):
    from bigfit.settings.config import TrainConfig

    split = dict(chunks=2, pipeline_schedule="1f1b") if strategy == "pipeline" else {}
    if strategy == "device_map":
        split = dict(device_map="auto", chunks=2)
    values = dict(model=str(model_dir), data=str(data), output_dir=str(out), strategy=strategy, precision="fp32",
                  max_steps=3, batch_size=8, micro_batch_size=2 if strategy != "pipeline" else 4, warmup_steps=0,
                  eval_every=0, eval_on_start=False, save_every=0, eval_samples=0, consolidate=False, lr=3e-3,
                  lora=True, lora_r=4, lora_alpha=8.0, lora_dropout=0.0, **split)
    return TrainConfig(**{**values, **kw})


def run(model_dirs, data, root, strategies) -> None:
    from dist import train

    for strategy in strategies:
        for family in FAMILIES:
            save = 2 if RESUMED.get(strategy) == family else 0  # a FREE setting: the run's math is the same
            train(job(model_dirs[family], data, root / f"{family}-{strategy}", strategy, save_every=save))
        if family := RESUMED.get(strategy):  # into a directory of its own: the whole run stays as it was
            step2 = root / f"{family}-{strategy}" / "checkpoints" / "step-00000002"
            train(job(model_dirs[family], data, root / f"{family}-{strategy}-resumed", strategy, resume=str(step2)))


@pytest.fixture(scope="module")
def runs(model_dirs, pairs_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")

    def references():
        with torch_threads(threads_per_rank(2)):
            run(model_dirs, pairs_file, root, ("single", "device_map"))

    run_ranks(run, 2, model_dirs, pairs_file, root, DISTRIBUTED, meanwhile=references)
    return root


@functools.lru_cache(maxsize=None)  # each run's checkpoint is compared several times: read it once
def final_state(run_dir) -> dict:
    """The last checkpoint's model and optimizer state, read on this process (DCP -> torch.save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    dcp_to_torch_save(ckpt, run_dir / "final.pt")
    return torch.load(run_dir / "final.pt", weights_only=False)


@functools.lru_cache(maxsize=None)
def seeded_base(model_dir) -> dict[str, torch.Tensor]:
    """The injected model's initial values, as every strategy's seeded init makes them (CPU)."""
    from bigfit.settings.config import TrainConfig
    from bigfit.loading import init_whole
    from bigfit.adapters.lora import LoraSettings, inject
    from bigfit.models.source import build_model, load_config, locate

    src = locate(str(model_dir))
    model = build_model(src, load_config(src), 0, on_meta=True)
    inject(model, LoraSettings.from_config(TrainConfig(lora=True, lora_r=4, lora_alpha=8.0, lora_dropout=0.0)))
    init_whole(model, 0, "cpu")
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", (*DISTRIBUTED, "device_map"))
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_matches_single_process_lora(runs, family, strategy):
    ref, got = runs / f"{family}-single", runs / f"{family}-{strategy}"
    ref_losses = [r["loss"] for r in read_jsonl(ref / "metrics.jsonl")]
    got_losses = [r["loss"] for r in read_jsonl(got / "metrics.jsonl")]
    assert len(ref_losses) == 3 and min(ref_losses[1:]) < ref_losses[0]  # it trained (and lora_B moved: below)
    a, b = final_state(ref)["model"], final_state(got)["model"]
    adapters = [k for k in a if ".lora_" in k]
    assert adapters and set(a) == set(b)
    loss_diff = max(abs(x - y) / x for x, y in zip(ref_losses, got_losses))
    worst = max((a[k] - b[k]).abs().max().item() for k in adapters)
    print(f"{family} lora {strategy}: max loss rel diff {loss_diff:.1e}, max adapter diff {worst:.1e}")
    assert loss_diff <= LOSS_TOL, f"losses {got_losses} vs {ref_losses}"
    assert worst <= PARAM_TOL, f"largest adapter difference {worst:.2e}"
    assert any(a[k].abs().max() > 0 for k in adapters if ".lora_B." in k)  # B starts at zero: it moved


@pytest.mark.parametrize("strategy", ("single", *DISTRIBUTED, "device_map"))
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_hold_the_adapters_alone_and_only_they_have_optimizer_state(runs, model_dirs, family, strategy):
    from bigfit.outputs.ckptdir import frozen_of, trainer_state

    run_dir = runs / f"{family}-{strategy}"
    state = final_state(run_dir)
    adapters = {k for k in seeded_base(model_dirs[family]) if ".lora_" in k}
    assert adapters and set(state["model"]) == adapters  # no base weight, no buffer
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert frozen_of(trainer_state(ckpt)) == {"in_checkpoint": False, "source": str(model_dirs[family].resolve()),
                                              "init_device": "cpu"}
    if strategy != "zero2-offload":  # the offload engine keeps its moments under its own names
        optim = state["optim"]  # nested, or flattened as "state.<name>.<field>" (pipeline stages)
        names = list(optim["state"]) if "state" in optim else [k for k in optim if k.startswith("state.")]
        assert names and all(".lora_" in k for k in names)


def tensors(tree, prefix="") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return {k: v for key, sub in items for k, v in tensors(sub, f"{prefix}.{key}").items()}


@pytest.mark.parametrize("strategy,family", RESUMED.items())
def test_lora_resume_from_adapters_alone_continues_exactly(runs, strategy, family):
    """The resumed run made its base again (the seeded init) and loaded the adapters and moments
    alone: its third loss and its final adapters and optimizer states are the whole run's, bit for bit."""
    whole, part = runs / f"{family}-{strategy}", runs / f"{family}-{strategy}-resumed"
    resumed = read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [3]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in read_jsonl(whole / "metrics.jsonl")][2:]
    a, b = tensors(final_state(whole)), tensors(final_state(part))
    assert any(".lora_" in k for k in a) and any(k.startswith(".optim") for k in a) and set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


@pytest.mark.parametrize("strategy,family", [("single", "t5"), ("zero3", "llama")])
def test_merge_makes_the_seeded_base_again(runs, model_dirs, tmp_path, strategy, family):
    """A config-only model's base is bigfit's seeded init: consolidate --merge makes it again (the
    run's seed, the adapters injected first) and folds the checkpoint's adapters in, bit for bit."""
    from safetensors.torch import load_file

    from bigfit.outputs.consolidate import consolidate

    run_dir = runs / f"{family}-{strategy}"
    out = consolidate(sorted((run_dir / "checkpoints").glob("step-*"))[-1], tmp_path / "merged", merge=True)
    merged, init, state = load_file(out / "model.safetensors"), seeded_base(model_dirs[family]), final_state(run_dir)
    adapted = 0
    for name, t in merged.items():
        path = name.removesuffix(".weight")
        a, b = (state["model"].get(f"{path}.lora_{x}.default.weight") for x in "AB")
        want = init[name] if a is None else init[f"{path}.base_layer.weight"] + (b @ a) * 2.0  # alpha / r
        assert torch.equal(t, want), name
        adapted += a is not None
    assert adapted == len(state["model"]) // 2


@pytest.mark.parametrize("family,targets", [("t5", "all-linear"), ("t5", "q,v"), ("gpt2", "all-linear"),
                                            ("gpt2", "c_attn"), ("llama", "all-linear"), ("llama", "q_proj,v_proj")])
def test_the_disk_check_counts_the_adapters_peft_adds(model_dirs, family, targets):
    from bigfit.adapters.lora import LoraSettings, adapter_parameters, inject, trainable_parameters
    from bigfit.models.source import build_model, load_config, locate

    src = locate(str(model_dirs[family]))
    model, settings = build_model(src, load_config(src), 0, on_meta=True), LoraSettings(r=4, targets=targets)
    counted = adapter_parameters(model, settings)
    assert counted == trainable_parameters(inject(model, settings)) > 0


def test_the_disk_check_refuses_a_full_checkpoint_where_a_lora_one_fits(model_dirs, pairs_file, tmp_path, monkeypatch):
    from bigfit.errors import BigfitError
    from bigfit.outputs import ownership, rundir
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import prepare

    monkeypatch.setattr(rundir, "free_bytes", lambda path: 100_000)  # the tiny Llama: 518 kB in full, 49 kB of adapters
    out = tmp_path / "out"
    assert ownership._check_space(prepare(resolve(job(model_dirs["llama"], pairs_file, out, "single"), 1)), out) == []
    full = prepare(resolve(job(model_dirs["llama"], pairs_file, out, "single", lora=False, lora_r=16, lora_alpha=32.0,
                               lora_dropout=0.05), 1))  # the defaults: --lora-* values without --lora are refused
    with pytest.raises(BigfitError, match="one checkpoint of this model takes"):
        ownership._check_space(full, out)


@pytest.mark.parametrize("argv,message", [
    (["--lora-r", "8"], "--lora-r set without --lora"),
    (["--lora", "--lora-r", "0"], "--lora needs --lora-r >= 1"),
    (["--lora", "--lora-targets", "q_proj,nope"], "nope matches no linear layer of this model; its linear layers are"),
    (["--lora", "--tp", "2", "--sequence-parallel", "--nproc", "2"], "--lora with --sequence-parallel: adapters on"),
])
def test_bad_lora_settings_are_one_line_before_any_work(model_dirs, tmp_path, capsys, argv, message):
    from bigfit.cli import main

    assert main(["train", "--model", str(model_dirs["llama"]), "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and len(capsys.readouterr().err.strip().splitlines()) <= 1
    assert not (tmp_path / "out").exists()


def _train_one(cfg) -> None:
    from dist import train

    train(cfg)


def test_lora_on_saved_weights_reads_the_base_by_its_own_names(pairs_file, tmp_path):
    """Per-rank loading of a safetensors base under the adapters: each rank reads its shards of
    `...q_proj.weight` for `...q_proj.base_layer.weight`; zero3 on 2 ranks matches one process. Its
    checkpoint holds the adapters alone: `consolidate --merge` reads the base from the file again,
    every weight the file's, bit for bit, the targeted ones plus B A alpha / r."""
    from safetensors.torch import load_file

    from bigfit.outputs.consolidate import consolidate
    from tiny import twin_models

    base, _ = twin_models("llama")
    base.save_pretrained(tmp_path / "base")
    saved = load_file(tmp_path / "base" / "model.safetensors")
    ref, got = tmp_path / "single", tmp_path / "zero3"
    _train_one(job(tmp_path / "base", pairs_file, ref, "single"))
    run_ranks(_train_one, 2, job(tmp_path / "base", pairs_file, got, "zero3"))
    losses = [[r["loss"] for r in read_jsonl(d / "metrics.jsonl")] for d in (ref, got)]
    assert losses[1] == pytest.approx(losses[0], rel=LOSS_TOL)
    state = final_state(got)["model"]
    merged = load_file(consolidate(got / "checkpoints" / "step-00000003", tmp_path / "merged", merge=True)
                       / "model.safetensors")
    assert set(merged) == set(saved) and all(".lora_" in k for k in state)
    for name, t in saved.items():
        a, b = (state.get(f"{name.removesuffix('.weight')}.lora_{x}.default.weight") for x in "AB")
        assert torch.equal(merged[name], t if a is None else t + (b @ a) * 2.0), name  # alpha / r


def test_a_frozen_base_under_autocast_is_stored_in_bf16_and_trains_as_the_fsdp2_reference(model_dirs, pairs_file,
                                                                                          tmp_path):
    """single in bf16 (autocast): the base in bf16 (as a peft user loads it), adapters in fp32; its
    losses follow FSDP2's bf16 mixed precision (zero3 on one process) within the mechanisms' tolerance."""
    from bigfit.common.distributed import init_runtime
    from bigfit.adapters.lora import LoraSettings, inject
    from bigfit.parallel.apply import apply
    from bigfit.job.resolution import resolve
    from dist import train
    from tiny import twin_models

    model, _ = twin_models("llama")
    resolved = resolve(job(model_dirs["llama"], pairs_file, tmp_path / "x", "single", precision="bf16"), 1)
    cfg = resolved.cfg
    inject(model, LoraSettings.from_config(cfg))
    engine = apply(model, resolved.plan, cfg, init_runtime())
    dtypes = {n: p.dtype for n, p in engine.module.named_parameters()}
    assert all(d == (torch.float32 if ".lora_" in n else torch.bfloat16) for n, d in dtypes.items())
    runs = {s: tmp_path / s for s in ("single", "zero3")}
    for s, out in runs.items():
        train(job(model_dirs["llama"], pairs_file, out, s, precision="bf16", max_steps=2))
    a, b = ([r["loss"] for r in read_jsonl(out / "metrics.jsonl")] for out in runs.values())
    assert b == pytest.approx(a, rel=1e-2)  # autocast against FSDP2's casts: test_parity's MECHANISM_TOL


def test_a_lora_run_ends_with_its_adapter_directory_and_overwrite_replaces_it(model_dirs, pairs_file, tmp_path):
    from bigfit.outputs import rundir
    from dist import train

    out = tmp_path / "out"
    cfg = job(model_dirs["gpt2"], pairs_file, out, "single", max_steps=2, consolidate=True)
    summary = train(cfg)
    assert summary["adapter_dir"] == out / "adapter" and not (out / "model").exists()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "adapter").iterdir()}
    contents = rundir.inspect(out)
    assert "adapter/" in contents.describe() and out / "adapter" / "adapter_model.safetensors" in contents.model
    (out / "adapter" / "notes.txt").write_text("mine")  # a user's file: kept through --overwrite
    train(job(model_dirs["gpt2"], pairs_file, out, "single", max_steps=2, consolidate=True, overwrite=True))
    assert (out / "adapter" / "notes.txt").read_text() == "mine"
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_resume_refuses_a_base_whose_weight_files_changed(pairs_file, tmp_path, capsys):
    """A LoRA checkpoint holds the adapters alone; the base is read from --model's files at every
    start, so resuming or merging over other weights of the same architecture is refused (their
    fingerprint)."""
    from bigfit.cli import main
    from tiny import twin_models

    base, _ = twin_models("llama")
    base.save_pretrained(tmp_path / "base")
    args = ["train", "--model", str(tmp_path / "base"), "--data", str(pairs_file), "--lora", "--strategy", "single",
            "--batch-size", "4", "--save-every", "2", "--eval-samples", "0", "--no-consolidate",
            "--lr-schedule", "constant", "--output-dir", str(tmp_path / "out")]
    assert main([*args, "--max-steps", "2"]) == 0
    with torch.no_grad():
        base.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # another checkpoint of the same shapes
    base.save_pretrained(tmp_path / "base")
    capsys.readouterr()
    assert main([*args, "--max-steps", "4", "--resume"]) == 2
    assert "model (the frozen base's weight files: fingerprint" in capsys.readouterr().err
    ckpt = tmp_path / "out" / "checkpoints" / "step-00000002"
    assert main(["consolidate", str(ckpt), str(tmp_path / "merged"), "--merge"]) == 2  # nor merged over them
    assert "are not the ones this run trained over" in capsys.readouterr().err
    assert main([*args, "--max-steps", "4", "--resume", "--allow-changed", "model"]) == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3, 4]
