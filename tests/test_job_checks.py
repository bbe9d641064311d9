"""Settings that were wrong without a word, tracebacks for flags, and the help text: every numeric
setting outside its range is one line before torch loads, --eval-samples past the data's hold-out is
one line where the data is read, the start-of-run table says when evaluation runs, --calibrate plans
without a writable cache, a plan that rejects every candidate gives each one's reason, and every flag
of every command has help that reads as words, not Python names."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys

import pytest
from transformers import LlamaConfig

from bigfit.cli import main
from bigfit.commands import calibrate
from bigfit.machine import calibration, hardware
from bigfit.settings import config
from bigfit.settings.config import TrainConfig
from conftest import one_line

# (flags, the one line's words): each outside its setting's range (config.RANGES), found before any work
OUT_OF_RANGE = [
    (["--adam-beta1", "1.5"], "--adam-beta1 must be at least 0 and less than 1, got 1.5"),
    (["--adam-beta2", "1"], "--adam-beta2 must be at least 0 and less than 1, got 1.0"),
    (["--weight-decay", "-1"], "--weight-decay must be 0 or more, got -1.0"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be 0 or more (0: no clipping), got -1.0"),
    (["--adam-eps", "0"], "--adam-eps must be more than 0, got 0.0"),
    (["--lr", "-0.1"], "--lr must be more than 0, got -0.1"),
    (["--warmup-steps", "-1"], "--warmup-steps must be 0 or more, got -1"),
    (["--warmup-min-lr=-1e-5"], "--warmup-min-lr must be 0 or more, got -1e-05"),
    (["--min-lr", "-1"], "--min-lr must be 0 or more, got -1.0"),
    (["--loss-scale", "-1"], "--loss-scale must be 0 or more (0: dynamic scaling), got -1.0"),
    (["--initial-scale-power", "200"], "--initial-scale-power must be from 0 to 127, got 200"),
    (["--loss-scale-window", "0"], "--loss-scale-window must be at least 1, got 0"),
    (["--hysteresis", "0"], "--hysteresis must be at least 1, got 0"),
    (["--min-loss-scale", "0"], "--min-loss-scale must be more than 0, got 0.0"),
    (["--ddp-bucket-mb", "0"], "--ddp-bucket-mb must be more than 0, got 0.0"),
    (["--seed", "-1"], "--seed must be from 0 to 4294967295, got -1"),
    (["--tp", "0"], "--tp must be a positive integer, got 0"),
    (["--dp-replicate", "-2"], "--dp-replicate must be a positive integer, got -2"),
    (["--timeout-s", "0"], "--timeout-s must be more than 0, got 0.0"),
    (["--stages-per-rank", "0"], "--stages-per-rank must be at least 1, got 0"),
    (["--eval-samples", "-1"], "--eval-samples must be 0 or more (0: no evaluation), got -1"),
    (["--strategy", "zero2-offload-nvme", "--nvme-host-gb", "-1"],
     "--nvme-host-gb must be 0 or more (0: every state in files), got -1.0"),
]
# Runs every case through the command's entry point in one process, as `bigfit train` would, and says
# whether torch was imported by then: these mistakes are said in a fraction of a second.
_RUN_ALL = """
import contextlib, io, json, sys
from bigfit.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["train", "--output-dir", sys.argv[2], *argv])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
    out.append([code, err.getvalue()])
print(json.dumps({"results": out, "torch": "torch" in sys.modules}))
"""


def test_out_of_range_settings_are_one_line_before_torch_loads(tmp_path):
    r = subprocess.run([sys.executable, "-c", _RUN_ALL, json.dumps([a for a, _ in OUT_OF_RANGE]), str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout.splitlines()[-1])
    for (argv, words), (code, err) in zip(OUT_OF_RANGE, said["results"]):
        assert code == 2 and one_line(err) == f"error: {words}", argv
    assert not said["torch"] and not (tmp_path / "out").exists()


def test_a_config_file_value_out_of_range_is_the_same_line(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("adam_beta1: 1.5\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--output-dir", str(tmp_path / "o")]) == 2
    assert one_line(capsys.readouterr().err) == "error: --adam-beta1 must be at least 0 and less than 1, got 1.5"


def test_every_numeric_setting_has_a_range_and_its_ends_are_valid():
    from bigfit.job.checks import validate
    from bigfit.settings.config import RANGES
    from bigfit.settings.reading import field_type, setting_names

    numeric = [n for n in setting_names() if field_type(n)[0] in (int, float) and not n.startswith("lora_")]
    assert sorted(set(numeric) - set(RANGES)) == []  # --lora-*: LoraSettings.checked, with --lora
    validate(TrainConfig(max_grad_norm=0, adam_beta1=0, weight_decay=0, seed=2**32 - 1, initial_scale_power=127,
                         eval_every=0, save_every=0, eval_samples=0, loss_scale=0))  # each end that is valid


def _data(tmp_path, n: int):
    from tiny import write_pairs

    return write_pairs(tmp_path / "pairs.jsonl", n=n)


@pytest.mark.parametrize("cache", ["off", "dir"])
def test_eval_samples_past_a_tenth_of_the_data_is_refused_where_it_is_read(model_dirs, tmp_path, capsys, cache):
    data = _data(tmp_path, 200)
    code = main(["train", "--model", str(model_dirs["t5"]), "--data", str(data), "--eval-samples", "100000",
                 "--data-cache", "off" if cache == "off" else str(tmp_path / "cache"), "--strategy", "single",
                 "--batch-size", "4", "--max-steps", "1", "--no-eval-on-start", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err  # the cache's tokenizing shows its progress above
    assert code == 2 and "Traceback" not in err
    assert (one_line(err) if cache == "off" else err.strip().splitlines()[-1]) == (
        "error: --eval-samples 100000: the data gives 200 samples, of which at most a tenth (20) is held out for "
        "evaluation; give --eval-samples 20 or fewer (0: no evaluation), or more data")
    assert not (tmp_path / "out").exists()


def _table(tmp_path, n: int, **kw) -> dict[str, str]:
    import torch

    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import describe, prepare

    cfg = TrainConfig(data=str(_data(tmp_path, n)), output_dir=str(tmp_path / "o"), strategy="single", nproc=1,
                      batch_size=4, **kw)
    return dict(describe(prepare(resolve(cfg, 1)), 1, torch.device("cpu"), []))


def test_the_start_of_run_table_says_when_evaluation_and_checkpoints_run(tmp_path):
    rows = _table(tmp_path, 200, eval_every=0, save_every=0)
    assert rows["eval"].startswith("at step 0 and at the end: loss")
    assert rows["checkpoints"].startswith("at the end only, in ")
    assert rows["data"].endswith("180 train / 20 eval samples (--eval-samples 64: at most a tenth of the data is "
                                 "held out)")  # the default, on data too small for it
    rows = _table(tmp_path, 200, eval_every=5, eval_on_start=False, save_every=5, eval_samples=20)
    assert rows["eval"].startswith("every 5 steps and at the end: loss") and rows["data"].endswith("20 eval samples")
    assert rows["checkpoints"].startswith("every 5 steps and at the end, in ")


def test_calibrate_without_a_writable_cache_measures_and_plans(tmp_path, monkeypatch, capsys):
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "_UNKEPT", {}, raising=False)
    # the measures themselves take a minute on 2 busy cores: what is tested is where their figures go
    monkeypatch.setattr(calibrate, "measure", lambda device: {"host_op_us": 123.4, "device": device.type,
                                                                "operators": 900, "step_s": 0.11})
    monkeypatch.setattr(calibrate.adamrate, "rates", lambda: {"torch": 1e9})
    monkeypatch.setattr(calibration, "measure_cpu", lambda: {"tflops": 0.1, "mem_gbps": 5.0, "cores": 2})
    assert main(["plan", "--calibrate", "--gpus", "1x24GB"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"not kept: {tmp_path / 'cache' / 'bigfit' / 'host.json'} cannot be written" in out
    assert "this plan uses them, later ones can with --host-op-us 123.4" in out
    assert hardware.calibrated_host_op_us("cpu") == 123.4  # this process's plans use it (a CPU-only machine's key)


def test_a_plan_that_rejects_every_candidate_gives_each_reason(tmp_path, capsys):
    """An 8B Llama at 32K tokens on one H100 (activation checkpointing, 25 GB of host RAM): zero3-offload
    fits the GPU but not the host, the rest are over the GPU. Traced on fake tensors: a few seconds."""
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                tie_word_embeddings=False).save_pretrained(tmp_path / "llama-8b")
    assert main(["plan", "--model", str(tmp_path / "llama-8b"), "--gpus", "1xH100", "--seq-len", "32768",
                 "--batch-size", "1", "--activation-checkpointing", "--cpu-ram", "25GB", "--loss-chunk", "0",
                 "--json"]) == 0  # the whole logits (--loss-chunk auto's chunks would fit zero2-offload's GPU)
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended"] is None and all(s["why_not"] for s in plan["strategies"])
    reason = plan["reason"]
    assert re.match(r"no candidate can run here: zero3-offload needs [\d.]+ GB of host RAM per node, more than 90% "
                    r"of 25\.0 GB; over the 84\.4 GB a GPU offers: zero2-offload [\d.]+ GB, ", reason), reason
    assert all(s["name"] in reason for s in plan["strategies"])  # each candidate, with its reason or its need


def _flags():
    """(command, action) for every flag and argument of every command."""
    from bigfit.cli import parsers

    _, commands = parsers()
    return [(name, a) for name, p in commands.items() for a in p._actions if a.help != argparse.SUPPRESS]


# Python names a help text must not show: settings/config.py's tuples of names, None, and settings' field names
# (a flag is --max-steps, not max_steps); a strategy's own name (device_map) is a value users type.
_FIELDS = {f.name for f in dataclasses.fields(TrainConfig) if "_" in f.name} - set(config.SPLIT_STRATEGIES)
_CONSTANTS = {n for n, v in vars(config).items() if n.isupper() and isinstance(v, tuple)}


def test_every_flag_of_every_command_has_help_in_words():
    for command, action in _flags():
        text, flag = action.help or "", "/".join(action.option_strings) or action.dest
        assert text.strip(), f"bigfit {command} {flag} has no help"
        words = set(re.findall(r"(?<![-/.\w])[A-Za-z]\w*", text))
        assert not words & (_CONSTANTS | _FIELDS | {"None"}), f"bigfit {command} {flag}: {text}"
    from bigfit.settings.reading import field_help as _field_help

    helps = _field_help()
    assert helps["strategy"].startswith("one of single, ddp, zero1, zero2, zero3, zero2-offload, zero3-offload, "
                                        "zero2-offload-nvme, device_map, pipeline, or auto: the fastest")
    assert helps["micro_batch_size"].startswith("samples per forward/backward on one process; default: --batch-size")
    assert helps["sequence_parallel"].startswith("with --tp: the residual stream") and "reduce-scattered" in helps[
        "sequence_parallel"]
    assert "0: no clipping" in helps["max_grad_norm"] and "0: at the end only" in helps["eval_every"]


@pytest.mark.parametrize("command", ["train", "plan", "bench", "consolidate"])
def test_help_prints(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0 and "--help" in capsys.readouterr().out
