"""bigfit.train and bigfit.plan: the commands from Python, returning data; mistakes are one BigfitError
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
    result = bigfit.train(model=str(model_dirs["t5"]), data=str(pairs_file), strategy="single", output_dir=str(out), **RUN)
    assert result["output_dir"] == str(out) and result["model_dir"] == str(out / "model")
    assert result["metrics"] == read_jsonl(out / "metrics.jsonl")[-1] and result["metrics"]["step"] == 2
    assert result["eval"]["step"] == 2 and "eval_bleu" in result["eval"]
    assert (out / "model" / "config.json").exists()


def test_run_on_two_worker_processes_takes_a_train_config(model_dirs, pairs_file, tmp_path):
    cfg = bigfit.TrainConfig(model=str(model_dirs["llama"]), data=str(pairs_file), strategy="zero3", nproc=2,
                             output_dir=str(tmp_path / "out"), consolidate=False, **RUN)
    result = bigfit.train(cfg)
    assert result["metrics"]["step"] == 2 and "model_dir" not in result
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["starts"][-1]["world_size"] == 2
    assert (tmp_path / "out" / "logs" / "rank-1.log").exists()  # the second worker: a process of its own


@pytest.mark.parametrize("kwargs,needle", [
    (dict(max_step=3), "unknown setting(s) 'max_step' (did you mean max_steps?) in bigfit.train()"),
    (dict(strategy="zero4"), "strategy 'zero4' is not valid; choose one of: single, ddp"),
    (dict(batch_size="many"), "batch_size"),
])
def test_a_bad_setting_raises_one_line_before_any_work(tmp_path, kwargs, needle):
    with pytest.raises(BigfitError) as e:
        bigfit.train(output_dir=str(tmp_path / "out"), **kwargs)
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


def test_run_takes_a_model_object_and_a_dataset_object(pairs_file, tmp_path):
    """The objects are written once to bigfit's cache of inputs (XDG_CACHE_HOME: conftest.py), read by
    the run as paths, and given again are the same paths: the second run resumes the first."""
    datasets = pytest.importorskip("datasets")
    import torch
    from transformers import AutoModelForCausalLM, ByT5Tokenizer

    from tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = datasets.Dataset.from_list(read_jsonl(pairs_file))
    args = dict(model=model, tokenizer=ByT5Tokenizer(), data=data, strategy="single", output_dir=str(tmp_path / "out"))
    first = bigfit.train(**args, **{**RUN, "save_every": 1})
    again = bigfit.train(**args, **{**RUN, "max_steps": 3}, resume="latest", allow_changed="max_steps")  # same model, data
    assert first["metrics"]["step"] == 2 and again["metrics"]["step"] == 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model is untouched
    trained = AutoModelForCausalLM.from_pretrained(first["model_dir"])
    assert not torch.equal(trained.state_dict()["lm_head.weight"], before["lm_head.weight"])
    pairs = [{"source": "one two", "target": "12"}] * 40
    assert bigfit.train(model=model, tokenizer=ByT5Tokenizer(), data=pairs, strategy="single", consolidate=False,
                      output_dir=str(tmp_path / "out2"), **RUN)["metrics"]["step"] == 2


@pytest.mark.parametrize("kwargs,needle", [
    (dict(model=object()), "model= takes a hub name, a directory or a transformers PreTrainedModel; got object"),
    (dict(data=[]), "data= takes a path, a hub dataset name, a datasets.Dataset or DatasetDict, or a list of example dicts; got list (empty)"),
    (dict(tokenizer=object()), "tokenizer= goes with model= given as a model object"),
])
def test_objects_that_are_no_model_or_data_are_one_line(tmp_path, kwargs, needle):
    with pytest.raises(BigfitError) as e:
        bigfit.train(output_dir=str(tmp_path / "out"), **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_bigfit_train_is_the_call_even_with_the_training_package_imported():
    import bigfit.training.loop  # noqa: F401  the package a submodule import would bind as bigfit.train

    assert callable(bigfit.train) and bigfit.run is bigfit.train


def test_plan_keeps_in_ram_what_the_ram_leaves_unless_told(model_dirs):
    """`bigfit plan` rates zero2-offload-nvme as `--strategy auto` does (the states RAM can hold stay
    there) unless --nvme-host-gb says how many; 0 puts every state on the disk."""
    flags = dict(model=str(model_dirs["llama"]), gpus="1x2GB", cpu_ram="8GB", nvme="10GB", batch_size=4, seq_len=64)

    def row(**more):
        (r,) = [s for s in bigfit.plan(**flags, **more)["strategies"] if s["name"] == "zero2-offload-nvme"]
        return r

    chosen, on_disk = row(), row(nvme_host_gb=0)
    assert chosen["per_host_bytes"]["optimizer"] > 0 and chosen["per_node_nvme_bytes"] == 0  # a tiny model: all in RAM
    assert on_disk["per_host_bytes"]["optimizer"] == 0 and on_disk["per_node_nvme_bytes"] > 0
