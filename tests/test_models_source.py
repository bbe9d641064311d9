"""A model directory's files that do not load, and a one-process run interrupted: one line each,
no traceback, before any process trains (nothing written), and an interrupted run's directory left
exact (its lock released, every checkpoint named complete intact)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import bigfit, one_line

TRAIN = ["--strategy", "single", "--max-steps", "2", "--eval-every", "0", "--no-eval-on-start", "--batch-size", "4",
         "--eval-samples", "4"]


def _train_args(model: Path, pairs_file: Path, out: Path) -> list[str]:
    return ["train", "--model", str(model), "--data", str(pairs_file), *TRAIN, "--output-dir", str(out)]


def _model_dir(model_dirs, tmp_path: Path, family: str = "gpt2") -> Path:
    return Path(shutil.copytree(model_dirs[family], tmp_path / "model"))


def _with_tokenizer(directory: Path) -> Path:
    """A small character-level tokenizer of the model's own (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 "
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(directory)
    return directory


# -- tokenizer files ----------------------------------------------------------------------------------

def test_a_corrupt_tokenizer_json_is_an_error_naming_it(model_dirs, pairs_file, tmp_path):
    """It was replaced by the byte-level tokenizer without a word, and that one saved with the model."""
    model = _with_tokenizer(_model_dir(model_dirs, tmp_path))
    (model / "tokenizer.json").write_bytes(os.urandom(256))
    r = bigfit(*_train_args(model, pairs_file, tmp_path / "out"))
    assert r.returncode == 2
    assert str(model / "tokenizer.json") in one_line(r.stderr)
    assert not (tmp_path / "out").exists()  # before any process trains


@pytest.mark.parametrize("damage", ["config_json", "config_bytes", "vocab_missing"])
def test_other_tokenizer_files_that_do_not_load(model_dirs, tmp_path, damage):
    from bigfit.errors import BigfitError
    from bigfit.models.source import load_config, locate
    from bigfit.models.tokenizer import load_tokenizer

    model = _with_tokenizer(_model_dir(model_dirs, tmp_path))
    if damage == "config_json":
        (model / "tokenizer_config.json").write_text('{"tokenizer_class": ')
    elif damage == "config_bytes":
        (model / "tokenizer_config.json").write_bytes(os.urandom(256))
    else:  # a class whose vocabulary file is absent loads with its special tokens alone
        (model / "tokenizer.json").unlink()
        (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    named = model / ("vocab.json" if damage == "vocab_missing" else "tokenizer_config.json")
    src = locate(str(model))
    with pytest.raises(BigfitError, match=str(named)):
        load_tokenizer(src, load_config(src))


def test_the_byte_level_tokenizer_only_without_tokenizer_files(model_dirs, tmp_path, monkeypatch):
    """A directory with none, the embedded default, and a hub name's in the local cache, which loads."""
    import huggingface_hub.constants

    from bigfit.models.source import ModelSource, load_config, locate
    from bigfit.models.tokenizer import describe_tokenizer, load_tokenizer

    for src, said in ((locate(str(model_dirs["t5"])), "byte-level (--model has no tokenizer files)"),
                      (locate(None), "byte-level (the embedded model's)")):
        assert describe_tokenizer(src, load_tokenizer(src, load_config(src))) == said
    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / ("a" * 40)
    _with_tokenizer(Path(shutil.copytree(model_dirs["gpt2"], snapshot)))
    (tmp_path / "hub" / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    src = ModelSource("hub", "someone/tiny")
    tok = load_tokenizer(src, load_config(src))
    assert describe_tokenizer(src, tok).startswith("the model's own") and tok("abc")["input_ids"][:3] == [3, 4, 5]


# -- config.json --------------------------------------------------------------------------------------

def test_a_config_value_of_the_wrong_type_is_one_line_naming_the_key(model_dirs, pairs_file, tmp_path):
    model = _model_dir(model_dirs, tmp_path, "llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    r = bigfit(*_train_args(model, pairs_file, tmp_path / "out"))
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert str(model / "config.json") in line and "hidden_size" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value", [("hidden_size", -32), ("hidden_act", "nonesuch")])
def test_config_values_that_build_no_model(model_dirs, tmp_path, key, value):
    """Found by building on the meta device where config.json is read, the key by trying each."""
    from bigfit.errors import BigfitError
    from bigfit.models.source import load_config, locate

    model = _model_dir(model_dirs, tmp_path, "llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(BigfitError, match=f'{model / "config.json"}: "{key}": {value!r} does not build the model'):
        load_config(locate(str(model)))


# -- weight files -------------------------------------------------------------------------------------

def test_random_bytes_in_model_safetensors(model_dirs, pairs_file, tmp_path):
    model = _model_dir(model_dirs, tmp_path)
    (model / "model.safetensors").write_bytes(os.urandom(4096))
    r = bigfit(*_train_args(model, pairs_file, tmp_path / "out"))
    assert r.returncode == 2
    assert str(model / "model.safetensors") in one_line(r.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated", "header_lies", "bin_bytes"])
def test_weight_files_that_do_not_open(model_dirs, pairs_file, tmp_path, capsys, damage):
    """Checked in the launcher, before the claim: a .bin is read by the rank-0 path, in the process that
    trains (its random bytes were a traceback there, the run directory already made)."""
    from bigfit.cli import main

    model = _model_dir(model_dirs, tmp_path)
    path = model / ("pytorch_model.bin" if damage == "bin_bytes" else "model.safetensors")
    save_file({"w": torch.zeros(64, 64)}, str(path))
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "header_lies":  # the header claims a tensor larger than the file holds
        n = int.from_bytes(data[:8], "little")
        header = data[8:8 + n].replace(b"[64,64]", b"[99,64]")
        path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n:])
    else:
        path.write_bytes(os.urandom(4096))
    assert main(_train_args(model, pairs_file, tmp_path / "out")) == 2
    assert str(path) in one_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


# -- interrupts ---------------------------------------------------------------------------------------

def test_ctrl_c_in_a_one_process_run_is_one_line(model_dirs, pairs_file, tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while it trains, saving a checkpoint
    every step: one line, the launcher's status 130, the lock released, every step-N complete."""
    out = tmp_path / "out"
    args = [*_train_args(model_dirs["t5"], pairs_file, out), "--max-steps", "100000", "--save-every", "1",
            "--keep-checkpoints", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("BIGFIT_FAULT", "BIGFIT_OUTPUT_CLAIMED")}
    p = subprocess.Popen([sys.executable, "-m", "bigfit", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**env, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    deadline = threading.Timer(240, p.kill)  # the bound on waiting for its first step
    deadline.start()
    try:
        shown = []
        for line in p.stdout:  # up to the line of the first step, or the end of the output
            shown.append(line)
            if line.startswith("first step"):
                break
        assert shown and shown[-1].startswith("first step"), p.stderr.read()
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate()
    finally:
        deadline.cancel()
    assert any("byte-level (--model has no tokenizer files)" in line for line in shown)  # the table says so
    assert p.returncode == 130, err
    assert one_line(err) == "interrupted (Ctrl-C): stopped"
    _exact_after_interrupt(out)


def test_sigterm_to_a_one_process_run_is_one_line(model_dirs, pairs_file, tmp_path, monkeypatch, capsys):
    """`kill`, `timeout`, a scheduler's stop while the one process trains: as Ctrl-C (in this process:
    a SIGTERM its handler does not take would end the test with an error, not kill it)."""
    from bigfit.cli import main
    from bigfit.commands import train as command

    class Unhandled(Exception):
        pass

    def unhandled(signum, frame):
        raise Unhandled("SIGTERM reached the default handler's place")

    monkeypatch.setattr(command, "_train", lambda job, ready=None: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        status = main(_train_args(model_dirs["t5"], pairs_file, tmp_path / "out"))
    finally:
        signal.signal(signal.SIGTERM, before)
    assert status == 130
    assert one_line(capsys.readouterr().err) == "interrupted (SIGTERM): stopped"
    _exact_after_interrupt(tmp_path / "out")


def _exact_after_interrupt(out: Path) -> None:
    from bigfit.outputs.ckptdir import damage, steps

    assert not (out / ".bigfit-lock").exists()
    assert all(damage(p) is None for p in steps(out / "checkpoints"))


def test_an_interrupt_inside_a_checkpoint_save_is_one_line_too(monkeypatch, capsys):
    """DCP catches every BaseException in its steps, Ctrl-C's KeyboardInterrupt too, and raises a
    CheckpointException carrying it: that is the interrupt as well, not a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    from bigfit import cli
    from bigfit.commands import train as command

    def save_interrupted(argv, cfg, given=None):
        raise CheckpointException("save", {0: (KeyboardInterrupt("SIGTERM"), None)})

    monkeypatch.setattr(command, "train_command", save_interrupted)
    assert cli.main(["train", "--strategy", "single"]) == 130
    assert one_line(capsys.readouterr().err) == "interrupted (SIGTERM): stopped"
    monkeypatch.setattr(command, "train_command", lambda argv, cfg, given=None: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # anything else keeps its traceback
        cli.main(["train", "--strategy", "single"])


def test_an_interrupt_during_the_probe_is_the_commands(tmp_path, monkeypatch):
    """micro-batch auto's worker sets are a quiet launch: an interrupt stops them and goes on to the
    command (one line), where it was "interrupted ..." and then "error: the micro-batch probe failed
    (exit status 130)", exit 2. The job's own launch still says it and returns 130."""
    from bigfit.commands import launch

    def interrupted(procs, *args):
        for p in procs.values():
            p.wait()  # `bigfit --help`: no torch, a fraction of a second
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_wait_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch.launch_local(["--help"], 1, tmp_path / "probe", quiet=True)
    assert launch.launch_local(["--help"], 1, tmp_path / "job", quiet=False) == 130
