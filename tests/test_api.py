"""bigfit.run and bigfit.plan: the commands from Python, returning data; mistakes are one BigfitError
before any work; several processes start as the command starts them (new processes, a settings file)."""
from __future__ import annotations

import json

import pytest

import bigfit
from bigfit.errors import BigfitError
from conftest import read_jsonl

RUN = dict(batch_size=4, max_steps=2, eval_every=0, eval_samples=4, num_beams=1, max_new_tokens=4, save_every=0)


def test_run_in_one_process_returns_the_metrics_and_the_model(model_dirs, pairs_file, tmp_path):
    out = tmp_path / "out"
    result = bigfit.run(model=str(model_dirs["t5"]), data=str(pairs_file), strategy="single", output_dir=str(out), **RUN)
    assert result["output_dir"] == str(out) and result["model_dir"] == str(out / "model")
    assert result["metrics"] == read_jsonl(out / "metrics.jsonl")[-1] and result["metrics"]["step"] == 2
    assert result["eval"]["step"] == 2 and "eval_bleu" in result["eval"]
    assert (out / "model" / "config.json").exists()


def test_run_on_two_worker_processes_takes_a_train_config(model_dirs, pairs_file, tmp_path):
    cfg = bigfit.TrainConfig(model=str(model_dirs["llama"]), data=str(pairs_file), strategy="zero3", nproc=2,
                             output_dir=str(tmp_path / "out"), consolidate=False, **RUN)
    result = bigfit.run(cfg)
    assert result["metrics"]["step"] == 2 and "model_dir" not in result
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["starts"][-1]["world_size"] == 2
    assert (tmp_path / "out" / "logs" / "rank-1.log").exists()  # the second worker: a process of its own


@pytest.mark.parametrize("kwargs,needle", [
    (dict(max_step=3), "unknown setting(s) 'max_step' (did you mean max_steps?) in bigfit.run()"),
    (dict(strategy="zero4"), "strategy 'zero4' is not valid; choose one of: single, ddp"),
    (dict(batch_size="many"), "batch_size"),
])
def test_a_bad_setting_raises_one_line_before_any_work(tmp_path, kwargs, needle):
    with pytest.raises(BigfitError) as e:
        bigfit.run(output_dir=str(tmp_path / "out"), **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_plan_returns_what_plan_json_prints(model_dirs, capsys):
    from bigfit.cli import main

    p = bigfit.plan(model=str(model_dirs["llama"]), gpus="2x24GB", batch_size=8, seq_len=64, activation_checkpointing=True)
    assert main(["plan", "--model", str(model_dirs["llama"]), "--gpus", "2x24GB", "--batch-size", "8", "--seq-len", "64",
                 "--activation-checkpointing", "--json"]) == 0
    assert p == json.loads(capsys.readouterr().out)
    assert p["recommended"] and p["job"]["checkpointing"] is True
    with pytest.raises(BigfitError, match="bigfit.plan\\(\\): unknown flag\\(s\\) 'gpu' \\(did you mean gpus\\?\\)"):
        bigfit.plan(model=str(model_dirs["llama"]), gpu="2x24GB")
    with pytest.raises(BigfitError, match="bigfit.plan\\(\\): .*argument --batch-size: .*'many'"):
        bigfit.plan(model=str(model_dirs["llama"]), batch_size="many")
