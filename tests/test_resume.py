"""Crash safety through the real command and launcher (2 workers, ZeRO-3): a worker SIGKILLed in the
middle of a save leaves no checkpoint that looks complete; --resume continues from the newest
complete one and logs exactly the losses of an uninterrupted run; `bigfit consolidate` writes a
directory transformers loads, equal to the checkpoint's tensors."""
from __future__ import annotations

import pytest
import torch

from conftest import bigfit, read_jsonl

ARGS = ["--max-steps", "6", "--save-every", "2", "--eval-every", "0", "--no-eval-on-start", "--batch-size", "8",
        "--nproc", "2", "--eval-samples", "8", "--num-beams", "2", "--max-new-tokens", "8", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def runs(model_dirs, pairs_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    common = [*ARGS, "--model", str(model_dirs["t5"]), "--data", str(pairs_file)]
    whole = bigfit("train", *common, "--output-dir", str(root / "whole"))
    assert whole.returncode == 0, whole.stderr
    killed = bigfit("train", *common, "--output-dir", str(root / "killed"), fault="save:4")
    ckpts = sorted(p.name for p in (root / "killed" / "checkpoints").iterdir())
    killed_metrics = read_jsonl(root / "killed" / "metrics.jsonl")
    resumed = bigfit("train", *common, "--output-dir", str(root / "killed"), "--resume")
    return dict(root=root, whole=whole, killed=killed, ckpts=ckpts, killed_metrics=killed_metrics, resumed=resumed,
                data=pairs_file)


def test_kill_during_save_is_reported_once_and_leaves_no_complete_checkpoint(runs):
    k = runs["killed"]
    assert k.returncode == 128 + 9  # as a shell reports a process killed by SIGKILL
    assert k.stderr.count("worker rank 0 was killed by SIGKILL") == 1
    assert runs["ckpts"] == [".step-00000004.partial", "step-00000002"]
    assert [r["step"] for r in runs["killed_metrics"]] == [1, 2, 3, 4]


def test_resume_logs_the_same_losses_as_an_uninterrupted_run(runs):
    assert runs["resumed"].returncode == 0, runs["resumed"].stderr
    whole = read_jsonl(runs["root"] / "whole" / "metrics.jsonl")
    resumed = read_jsonl(runs["root"] / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]  # bit for bit
    final = runs["root"] / "killed" / "checkpoints"
    assert sorted(p.name for p in final.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]


def test_consolidate_writes_a_loadable_model_equal_to_the_checkpoint(runs, tmp_path, capsys):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from bigfit.cli import main

    ckpt = runs["root"] / "whole" / "checkpoints" / "step-00000006"
    assert main(["consolidate", str(ckpt), str(tmp_path / "hf")]) == 0, capsys.readouterr().err  # in this process
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf")
    AutoTokenizer.from_pretrained(tmp_path / "hf")
    dcp_to_torch_save(str(ckpt), str(tmp_path / "all.pt"))  # torch's own, non-streaming consolidation
    reference = torch.load(tmp_path / "all.pt", weights_only=False)["model"]
    state = model.state_dict()
    assert set(state) <= set(reference)
    for name, tensor in state.items():
        assert torch.equal(tensor, reference[name]), name
    # the end-of-run model directory is the same consolidation
    end = AutoModelForSeq2SeqLM.from_pretrained(runs["root"] / "whole" / "model").state_dict()
    assert all(torch.equal(end[k], v) for k, v in state.items())


def test_fine_tune_from_a_saved_model_directory(runs, tmp_path, capsys):
    """--model pointing at a directory with weights (here: the consolidated output) loads them."""
    from bigfit.cli import main

    model_dir = runs["root"] / "whole" / "model"
    code = main(["train", "--model", str(model_dir), "--data", str(runs["data"]), "--strategy", "single",
                 "--max-steps", "1", "--batch-size", "8", "--eval-samples", "8", "--num-beams", "2", "--lr", "1e-9",
                 "--output-dir", str(tmp_path)])  # one process: the command trains in this one
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "[weights]" in out.out
    trained = read_jsonl(runs["root"] / "whole" / "eval.jsonl")[-1]["eval_loss"]
    again = read_jsonl(tmp_path / "eval.jsonl")[0]["eval_loss"]  # before any step: the loaded weights
    assert again == pytest.approx(trained, rel=1e-5)


def resume_each(model_dir, data, root, strategies):
    """On each rank: an uninterrupted 4-step run, then a run resumed from its step-2 checkpoint."""
    from bigfit.settings.config import TrainConfig
    from dist import train

    for strategy in strategies:
        common = dict(model=str(model_dir), data=str(data), strategy=strategy, max_steps=4, batch_size=8,
                      save_every=2, eval_samples=0, consolidate=False, lr=3e-3)
        train(TrainConfig(output_dir=str(root / strategy / "whole"), **common))
        train(TrainConfig(output_dir=str(root / strategy / "resumed"), **common,
                          resume=str(root / strategy / "whole" / "checkpoints" / "step-00000002")))


@pytest.mark.parametrize("strategy", ["zero1", "zero2-offload", "zero2-offload-nvme"])
def test_resume_with_bigfits_own_optimizer_checkpoints(model_dirs, pairs_file, tmp_path_factory, strategy):
    """zero1 and zero2-offload(-nvme) save their optimizer states in bigfit's own per-owner format."""
    from dist import run_ranks

    root = tmp_path_factory.getbasetemp() / "own-optimizers"
    if not (root / "zero2-offload-nvme" / "resumed" / "metrics.jsonl").exists():
        run_ranks(resume_each, 2, model_dirs["llama"], pairs_file, root, ("zero1", "zero2-offload", "zero2-offload-nvme"))
    whole = [r["loss"] for r in read_jsonl(root / strategy / "whole" / "metrics.jsonl")]
    resumed = [r["loss"] for r in read_jsonl(root / strategy / "resumed" / "metrics.jsonl")]
    assert resumed == whole[2:]  # steps 3 and 4, bit for bit


def test_offload_engine_checkpoint_resumes_at_another_world_size(model_dirs, pairs_file, tmp_path_factory):
    """The engine saves each rank's rows as DTensors: a 2-rank checkpoint resumes in one process."""
    from bigfit.settings.config import TrainConfig
    from dist import train
    from dist import run_ranks

    root = tmp_path_factory.getbasetemp() / "own-optimizers"
    if not (root / "zero2-offload-nvme" / "resumed" / "metrics.jsonl").exists():
        run_ranks(resume_each, 2, model_dirs["llama"], pairs_file, root, ("zero1", "zero2-offload", "zero2-offload-nvme"))
    out = root / "zero2-offload" / "resumed-one-process"
    train(TrainConfig(model=str(model_dirs["llama"]), data=str(pairs_file), strategy="zero2-offload", max_steps=4,
                      batch_size=8, save_every=2, eval_samples=0, consolidate=False, lr=3e-3, output_dir=str(out),
                      resume=str(root / "zero2-offload" / "whole" / "checkpoints" / "step-00000002")))
    whole = [r["loss"] for r in read_jsonl(root / "zero2-offload" / "whole" / "metrics.jsonl")]
    resumed = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert resumed == pytest.approx(whole[2:], rel=1e-6)  # only the order of fp32 sums differs


def convert_each(model_dir, data, root, pairs):
    """On each rank: for each (saved, resumed) pair of strategies, a 4-step run of the first and a
    run of the second resumed from its step-2 checkpoint."""
    from bigfit.settings.config import TrainConfig
    from dist import train

    common = dict(model=str(model_dir), data=str(data), max_steps=4, batch_size=8, save_every=2, eval_samples=0,
                  consolidate=False, lr=3e-3)
    for saved, resumed in pairs:
        whole = root / saved / "whole"
        if not (whole / "metrics.jsonl").exists():
            train(TrainConfig(output_dir=str(whole), strategy=saved, **common))
        train(TrainConfig(output_dir=str(root / saved / resumed), strategy=resumed, **common,
                          resume=str(whole / "checkpoints" / "step-00000002")))


# bigfit's own optimizers (zero1, the offload engine) save states without torch's param_groups, and
# pipeline ranks save theirs per parameter: each converts to and from the FSDP2 strategies
CONVERSIONS = [("zero1", "zero3"), ("zero3", "zero2-offload"), ("zero2-offload", "pipeline"), ("pipeline", "zero3")]


def test_checkpoints_convert_between_strategies(model_dirs, pairs_file, tmp_path_factory):
    """The resumed run's losses are the saving strategy's own, within 1e-5: its moments and step
    counts were loaded (restarted from zero, they move step 4's loss by 5e-4 relative here)."""
    from dist import run_ranks

    root = tmp_path_factory.mktemp("conversions")
    run_ranks(convert_each, 2, model_dirs["llama"], pairs_file, root, CONVERSIONS)
    for saved, resumed in CONVERSIONS:
        whole = [r["loss"] for r in read_jsonl(root / saved / "whole" / "metrics.jsonl")]
        again = [r["loss"] for r in read_jsonl(root / saved / resumed / "metrics.jsonl")]
        assert again == pytest.approx(whole[2:], rel=1e-5), (saved, resumed)
