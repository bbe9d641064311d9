"""Launching: the main job through bigfit's own launcher, two torchrun "nodes" on loopback, accelerate
launch, a failing worker brought to one clear report, and a causal LM on plain text with the same command."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_jsonl
from test_resume import bigfit

SMALL = ["--batch-size", "8", "--eval-samples", "8", "--num-beams", "2", "--max-new-tokens", "8"]


def test_main_job_end_to_end(tmp_path):
    """`bigfit train` on its embedded default (shortened): 2 workers, ZeRO-3, eval, checkpoints, model."""
    out = tmp_path / "out"
    r = bigfit("train", "--max-steps", "8", "--eval-every", "4", "--save-every", "4", *SMALL, "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert "zero3: dp_shard 2; ZeRO-3 (FSDP2)" in r.stdout and "model (Hugging Face)" in r.stdout
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9)) and all(m["loss"] > 0 for m in metrics)
    start = metrics[0]["startup_s"]  # the wait for step 1, phase by phase; once
    assert list(start) == ["command", "worker start", "data", "runtime", "model", "placement", "optimizer",
                           "eval at start", "first step"] and all(v >= 0 for v in start.values())
    assert not any("startup_s" in m for m in metrics[1:])
    assert f"first step {sum(start.values()):.1f} s after the command started: command" in r.stdout
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 4, 8] and all("eval_bleu" in e for e in evals)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000004", "step-00000008"]
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.num_layers == 3 and model.config.num_decoder_layers == 2
    ids = model.generate(**tok(["four two"], return_tensors="pt"), max_new_tokens=4, num_beams=2)
    assert ids.shape[0] == 1


def test_two_torchrun_nodes_on_loopback(tmp_path, model_dirs, pairs_file):
    from bigfit.commands.launch import free_port

    port, out = free_port(), tmp_path / "out"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    job = ["-m", "bigfit", "train", "--model", str(model_dirs["llama"]), "--data", str(pairs_file), "--max-steps",
           "3", "--eval-every", "0", "--save-every", "0", *SMALL, "--output-dir", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *common, "--node-rank", str(n), *job],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for n in (0, 1)]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    assert "on 2 x cpu" in outputs[0]  # node 0 holds rank 0, which prints
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert (out / "model" / "model.safetensors").is_file()
    job = json.loads((out / "job.json").read_text())  # the job each node's local rank 0 resolved, kept by rank 0
    assert (job["batching"]["world_size"], job["plan"]["dp_shard"]) == (2, 2)


def test_accelerate_launch_starts_the_workers_itself(tmp_path, model_dirs, pairs_file):
    """`accelerate launch -m bigfit train`: accelerate's processes are the job's ranks (its torchrun
    environment), bigfit starts none of its own. --multi_gpu is accelerate's multi-process mode; on a
    machine without GPUs its ranks run on the CPU over gloo."""
    pytest.importorskip("accelerate")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "bigfit",
                        "train", "--model", str(model_dirs["llama"]), "--data", str(pairs_file), "--max-steps", "2",
                        "--eval-every", "0", "--save-every", "0", *SMALL, "--output-dir", str(out)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("bigfit train") == 1  # rank 0 speaks, once
    assert json.loads((out / "run.json").read_text())["starts"][-1]["world_size"] == 2
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert not (out / "logs").exists()  # no launcher of bigfit's: it writes the other ranks' logs there


def test_a_failing_worker_stops_the_job_and_is_reported_once(tmp_path, model_dirs, pairs_file):
    r = bigfit("train", "--model", str(model_dirs["gpt2"]), "--data", str(pairs_file), "--max-steps", "5",
               "--eval-every", "0", *SMALL, "--output-dir", str(tmp_path), fault="step:2:1:raise")
    assert r.returncode == 1
    assert r.stderr.count("worker rank 1 failed: RuntimeError: injected fault at step 2 on rank 1") == 1
    assert "Traceback" in r.stderr  # not a user mistake: the traceback is kept, once
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_causal_lm_on_plain_text(tmp_path, model_dirs, capsys):
    from bigfit.cli import main

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(300)))
    for family in ("gpt2", "llama"):
        out = tmp_path / family
        code = main(["train", "--model", str(model_dirs[family]), "--data", str(text), "--strategy", "single",
                     "--max-steps", "4", "--batch-size", "4", "--max-source-len", "64", "--eval-samples", "4",
                     "--output-dir", str(out)])  # one process: the command trains in this one
        printed = capsys.readouterr()
        assert code == 0, printed.err
        assert "perplexity" in printed.out
        losses = [m["loss"] for m in read_jsonl(out / "metrics.jsonl")]
        assert len(losses) == 4 and losses[-1] < losses[0]
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(Path(out) / "model").config.model_type == family


def test_config_only_model_with_a_larger_vocabulary_than_the_byte_tokenizer(tmp_path, pairs_file):
    """A config.json alone (t5-large's vocabulary of 32128 rows, here 2000) gets the byte-level
    tokenizer's 384 tokens: a random head generates ids it has no token for, which evaluation drops
    instead of failing inside the tokenizer (found on the GPU machine, sixth session)."""
    from bigfit.cli import main
    from tiny import tiny_config

    cfg = tiny_config("t5")
    cfg.vocab_size = 2000
    cfg.save_pretrained(tmp_path / "model-dir")
    code = main(["train", "--model", str(tmp_path / "model-dir"), "--data", str(pairs_file), "--strategy", "single",
                 "--max-steps", "1", "--batch-size", "4", "--eval-samples", "4", "--num-beams", "2",
                 "--max-new-tokens", "6", "--no-consolidate", "--output-dir", str(tmp_path / "out")])
    assert code == 0
    assert "eval_bleu" in read_jsonl(tmp_path / "out/eval.jsonl")[-1]


def test_the_allocators_defaults_leave_the_users_choice(monkeypatch):
    """stamp_start (before torch is imported): 2 MB pages for the CPU's allocator, expandable segments
    for CUDA's; a setting of the user's, under either of torch's names, is kept as it is."""
    from bigfit.common.processes import stamp_start

    for key in ("THP_MEM_ALLOC_ENABLE", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "BIGFIT_STARTED_AT"):
        monkeypatch.delenv(key, raising=False)  # and put back as they were after the test
    stamp_start()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.setenv(key, "max_split_size_mb:128")
        stamp_start()
        assert os.environ[key] == "max_split_size_mb:128" and os.environ.get("PYTORCH_CUDA_ALLOC_CONF") in (
            None, "max_split_size_mb:128")
        monkeypatch.delenv(key)


def test_workers_share_the_cores_unless_the_user_set_threads(monkeypatch):
    """Each of N workers computes on its share of the cores (N threads per core spin against gloo's:
    DDP's step 6x slower on 2 cores); OMP_NUM_THREADS of the user's, and a single worker, are left alone."""
    from bigfit.commands import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert launch._threads(4) == {"OMP_NUM_THREADS": "4"}
    assert launch._threads(32) == {"OMP_NUM_THREADS": "1"}
    assert launch._threads(1) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch._threads(4) == {}


def test_sigterm_to_the_launcher_stops_its_workers(tmp_path, model_dirs, pairs_file):
    """`kill PID` (or `timeout`, a scheduler) on the launcher alone is Ctrl-C: its workers go with it,
    not left running on their own holding the devices, and it says so."""
    import signal
    import time

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "BIGFIT_FAULT"}
    proc = subprocess.Popen([sys.executable, "-m", "bigfit", "train", "--model", str(model_dirs["gpt2"]), "--data",
                             str(pairs_file), "--max-steps", "100000", "--eval-every", "0", "--no-eval-on-start",
                             *SMALL, "--output-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():  # the workers step
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    assert len(_naming(out)) == 3  # the launcher and its 2 workers
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    left = _naming(out)
    for pid in left:  # not left behind for the rest of the suite when this fails
        os.kill(pid, signal.SIGKILL)
    assert left == [] and proc.returncode == 130 and "interrupted (SIGTERM): all workers stopped" in err, err


def _naming(text) -> list[int]:
    """The processes whose command line names `text`."""
    found = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(text).encode() in cmd.read_bytes():
                found.append(int(cmd.parent.name))
        except OSError:  # ended while read
            pass
    return found
