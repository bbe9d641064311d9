"""The parallel plan (layout/plan.py): every strategy name resolves into the layout it always ran,
the degrees compose, and every combination bigfit cannot run is one line naming its numbers, before
any process starts. Pure: no processes, no model."""
from __future__ import annotations

import dataclasses

import pytest

from bigfit.errors import BigfitError
from bigfit.parallel import ALIASES, ParallelPlan, plan_for

# (strategy, world, degrees) -> (pp, dp_replicate, dp_shard, tp, zero, engine)
RESOLVED = [
    ("single", 1, {}, (1, 1, 1, 1, 0, "local")),
    ("ddp", 4, {}, (1, 4, 1, 1, 0, "ddp")),
    ("zero1", 4, {}, (1, 1, 4, 1, 1, "ddp")),
    ("zero1", 1, {}, (1, 1, 1, 1, 1, "local")),  # one process: nothing to shard or reduce
    ("zero2", 4, {}, (1, 1, 4, 1, 2, "fsdp")),
    ("zero3", 1, {}, (1, 1, 1, 1, 3, "fsdp")),  # FSDP2 on a one-rank mesh, for its mixed precision
    ("zero2-offload", 2, {}, (1, 1, 2, 1, 2, "offload")),
    ("zero2-offload-nvme", 1, {}, (1, 1, 1, 1, 2, "offload")),
    ("zero3-offload", 2, {}, (1, 1, 2, 1, 3, "fsdp")),
    ("pipeline", 4, {}, (4, 1, 1, 1, 0, "local")),
    ("device_map", 1, {}, (1, 1, 1, 1, 0, "local")),
    ("zero3", 8, dict(tp=2), (1, 1, 4, 2, 3, "fsdp")),  # FSDP2 x TP
    ("zero3", 2, dict(tp=2), (1, 1, 1, 2, 0, "local")),  # TP alone: nothing to shard beside it
    ("zero3", 4, dict(dp_replicate=2), (1, 2, 2, 1, 3, "fsdp")),  # HSDP
    ("pipeline", 4, dict(dp_replicate=2), (2, 2, 1, 1, 0, "ddp")),
    ("zero2", 4, dict(pp=2), (2, 1, 2, 1, 2, "fsdp")),
    ("zero1", 4, dict(pp=2), (2, 1, 2, 1, 1, "ddp")),  # DeepSpeed's PP x ZeRO-1
    ("zero2-offload", 4, dict(pp=2), (2, 1, 2, 1, 2, "offload")),  # each stage's optimizer in host RAM
    ("zero2-offload", 2, dict(pp=2), (2, 1, 1, 1, 2, "offload")),
    ("zero3-offload", 4, dict(tp=2), (1, 1, 2, 2, 3, "fsdp")),  # FSDP2's CPUOffloadPolicy on the 2-D mesh
    ("zero3-offload", 4, dict(pp=2), (2, 1, 2, 1, 3, "fsdp")),  # ... on each stage's units
    ("pipeline", 8, dict(tp=2, dp_replicate=2), (2, 2, 1, 2, 0, "ddp")),  # 3D
    ("zero3", 8, dict(pp=2, tp=2), (2, 1, 2, 2, 3, "fsdp")),  # 3D with FSDP2
]


@pytest.mark.parametrize("strategy,world,degrees,expected", RESOLVED)
def test_names_and_degrees_resolve_into_plans(strategy, world, degrees, expected):
    p = plan_for(strategy, world, **degrees)
    assert (p.pp, p.dp_replicate, p.dp_shard, p.tp, p.zero, p.engine) == expected
    assert p.pp * p.dp_replicate * p.dp_shard * p.tp == world and p.dp == p.dp_replicate * p.dp_shard
    assert ParallelPlan(**p.to_dict()) == p  # what the launcher hands its workers rebuilds the same plan


BAD = [
    ("zero3", 4, dict(tp=3), "tp 3 x pp 1 x dp_replicate 1 = 3 does not divide the 4 processes"),
    ("pipeline", 4, dict(pp=3), "multiply to 3, but the job has 4 processes"),
    ("ddp", 4, dict(dp_shard=2), "--dp-shard 2 shards model states, which needs ZeRO stage 1-3"),
    ("zero1", 4, dict(dp_replicate=2), "zero1 shards optimizer states over every data-parallel rank"),
    ("zero2-offload", 4, dict(tp=2), "offload engine shards over data-parallel ranks only"),
    ("ddp", 4, dict(tp=2), "DDP does not take tensor-parallel (DTensor) parameters"),
    ("zero3", 2, dict(sequence_parallel=True), "--sequence-parallel splits the sequence over tensor-parallel "
                                               "ranks: add --tp 2 or more"),
    ("pipeline", 4, dict(tp=2, sequence_parallel=True), "--sequence-parallel with --pp 2 is not supported yet"),
    ("zero3-offload", 2, dict(pp=2), "zero3-offload over pipeline stages needs 2 or more data-parallel ranks per "
                                     "stage (got pp 2 of 2 processes); use --nproc 4, or zero2-offload --pp 2"),
    ("device_map", 2, {}, "splits the model over the devices of one process, but the plan has 2"),
    ("zero3", 4, dict(tp=0), "--tp must be a positive integer, got 0"),
    ("zero9", 4, {}, "--strategy 'zero9' is not valid; choose one of: single, ddp"),
]


@pytest.mark.parametrize("strategy,world,degrees,needle", BAD)
def test_unsupported_layouts_are_one_line_naming_the_numbers(strategy, world, degrees, needle):
    with pytest.raises(BigfitError) as e:
        plan_for(strategy, world, **degrees)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_pipeline_interleaved_under_fsdp2_is_refused():
    p = plan_for("zero3", 4, pp=2, schedule="1f1b")
    with pytest.raises(BigfitError, match="interleaved pipeline"):
        dataclasses.replace(p, schedule="interleaved", stages_per_rank=2)


def test_every_alias_is_a_strategy_the_settings_accept():
    from bigfit.settings.config import PIPELINE_STRATEGIES, SPLIT_STRATEGIES, STRATEGIES

    assert set(ALIASES) == set(STRATEGIES + SPLIT_STRATEGIES + PIPELINE_STRATEGIES)


@pytest.mark.parametrize("argv,needle", [
    (["--nproc", "4", "--tp", "3"], "tp 3 x pp 1 x dp_replicate 1 = 3 does not divide the 4 processes"),
    (["--nproc", "2", "--tp", "2", "--strategy", "zero2-offload"], "offload engine shards over data-parallel"),
    (["--nproc", "2", "--tp", "2", "--strategy", "ddp"], "tensor parallel degree 2 does not divide the 3 "),
    (["--nproc", "2", "--tp", "2", "--sequence-parallel"], "--sequence-parallel does not support model type 'phi3'"),
    (["--nproc", "2", "--sequence-parallel"], "--sequence-parallel splits the sequence over tensor-parallel ranks"),
])
def test_train_refuses_bad_degrees_before_any_work(tmp_path, capsys, model_dirs, argv, needle):
    from bigfit.cli import main

    out = tmp_path / "out"
    model = model_dirs["t5"]
    if "ddp" in argv:  # a model whose heads the degree does not divide
        from tiny import tiny_config

        cfg = tiny_config("llama")
        cfg.num_attention_heads, cfg.num_key_value_heads = 3, 3
        cfg.hidden_size = 48
        cfg.save_pretrained(tmp_path / "three-heads")
        model = tmp_path / "three-heads"
    if "--sequence-parallel" in argv and "--tp" in argv:  # a plan whose fused qkv gathers its output
        from transformers import Phi3Config

        Phi3Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, pad_token_id=0).save_pretrained(tmp_path / "phi3")
        model = tmp_path / "phi3"
    assert main(["train", "--model", str(model), *argv, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()
