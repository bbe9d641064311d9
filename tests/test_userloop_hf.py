"""bigfit.hf.use: a Trainer, SFTTrainer and DPOTrainer on bigfit's strategies give plain Trainer's losses
(tiny Llama, fp32, 4 steps of 2 micro-batches); a 2-rank data-parallel run gives the 1-process run's;
resume from Trainer's checkpoint reaches the uninterrupted run's loss; save_model writes a directory
from_pretrained loads; mistakes are one line; the examples run.

Every run is a task of tests/dist.py's kept ranks (one rank for a one-process run): each Trainer finds
the process group there as torchrun leaves it, and the groups bigfit makes stay out of pytest's process."""
from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from dist import release, run_ranks


@pytest.fixture(scope="module", autouse=True)
def _ranks_ended_after():
    """This file's calls end their kept ranks with it (tests/dist.py release): its trainers leave their
    process groups in them (a later file's collectives would share the cores with their polling threads)."""
    yield
    release(1, 2)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# relative loss difference, bigfit against plain Trainer at one process: single and zero2 (FSDP2) were
# bit-equal; zero2-offload's host Adam step (its own C kernel) 0 on the losses, 1e-7 on the grad norm
TOL = {"single": 0.0, "zero2": 0.0, "zero2-offload": 1e-6}
# 2 ranks against 1 process: the same 8 samples a step, its gradients averaged over the ranks in
# another order of sums; measured 8e-8 (zero2, 2026-12-07)
TOL_RANKS = 1e-6


def tiny_model():
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def token_rows(n: int = 32, length: int = 16):
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, 300, (length,), generator=g).tolist() for _ in range(n)]
    return Dataset.from_list([{"input_ids": r, "labels": r} for r in rows])


def arguments(out, config=None, micro: int = 2, accum: int = 2, **extra):
    from transformers import TrainingArguments

    kw = dict(output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=accum, max_steps=4,
              learning_rate=1e-3, warmup_steps=1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
              seed=0, disable_tqdm=True)
    kw.update(extra)
    return (config or TrainingArguments)(**kw)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def finish(trainer, strategy):
    """Train; the losses Trainer logged; the engine's groups released (a kept rank runs the next task)."""
    import bigfit.hf

    if strategy:
        bigfit.hf.use(trainer, strategy=strategy)
    trainer.train()
    out = losses(trainer)
    if strategy:
        trainer.bigfit.close()
    return out


def run_trainer(out, strategy, micro=2, accum=2):
    from transformers import Trainer

    return finish(Trainer(model=tiny_model(), args=arguments(out, micro=micro, accum=accum), train_dataset=token_rows()),
                  strategy)


def run_sft(out, strategy):
    from datasets import Dataset
    from transformers import ByT5Tokenizer
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": f"{i} plus {i} is {2 * i}."} for i in range(32)])
    return finish(SFTTrainer(model=tiny_model(), args=arguments(out, SFTConfig, max_length=32), train_dataset=data,
                             processing_class=ByT5Tokenizer()), strategy)


def run_dpo(out, strategy):
    from datasets import Dataset
    from transformers import ByT5Tokenizer
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_list([{"prompt": f"{i} plus {i} is", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."}
                              for i in range(32)])
    model = tiny_model()  # a model from a config has no path DPOTrainer could build its reference from
    return finish(DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=arguments(out, DPOConfig, max_length=32),
                             train_dataset=data, processing_class=ByT5Tokenizer()), strategy)


def close(mine, theirs, tol):
    assert len(mine) == len(theirs) == 4, (mine, theirs)
    for a, b in zip(mine, theirs):
        assert abs(a - b) <= tol * abs(b), (mine, theirs)


@pytest.fixture(scope="module")
def plain_trainer(tmp_path_factory):
    """Plain Trainer's losses, once for the strategies compared with it."""
    return run_ranks(run_trainer, 1, tmp_path_factory.mktemp("plain"), None)[0]


@pytest.mark.parametrize("strategy", ["single", "zero2-offload"])
def test_trainer_matches_plain_trainer(tmp_path, plain_trainer, strategy):
    close(run_ranks(run_trainer, 1, tmp_path, strategy)[0], plain_trainer, TOL[strategy])


def test_two_ranks_match_one_process(tmp_path):
    """zero2 on 2 ranks, 2 samples each a micro-batch, against plain Trainer on 1 process, 4 a micro-batch:
    accelerate deals the batches of one seeded permutation to the processes in turn, so each step
    reads the same 8 samples (2 micro-batches of 4, or 2 of 2 on each rank); Trainer normalises by the
    step's target tokens over all processes, and the ranks average their gradients."""
    one = run_ranks(run_trainer, 1, tmp_path / "one", None, 4)[0]
    two = run_ranks(run_trainer, 2, tmp_path / "two", "zero2", 2)
    assert two[0] == two[1]
    close(two[0], one, TOL_RANKS)


def test_sft_trainer_matches_plain(tmp_path):
    close(run_ranks(run_sft, 1, tmp_path / "bigfit", "single")[0], run_ranks(run_sft, 1, tmp_path / "plain", None)[0], 0.0)


def test_dpo_trainer_matches_plain(tmp_path):
    close(run_ranks(run_dpo, 1, tmp_path / "bigfit", "single")[0], run_ranks(run_dpo, 1, tmp_path / "plain", None)[0], 0.0)


def resumed(out, strategy):
    """4 steps saving every 2; a new Trainer resumes from checkpoint-2; save_model; the saved weights."""
    from transformers import Trainer

    first = Trainer(model=tiny_model(), args=arguments(out, save_strategy="steps", save_steps=2), train_dataset=token_rows())
    whole = finish(first, strategy)
    again = Trainer(model=tiny_model(), args=arguments(out, save_strategy="steps", save_steps=2), train_dataset=token_rows())
    import bigfit.hf

    bigfit.hf.use(again, strategy=strategy)
    again.train(resume_from_checkpoint=str(Path(out) / "checkpoint-2"))
    again.save_model(str(Path(out) / "final"))
    state = {k: v.detach().clone() for k, v in again.bigfit.module.state_dict().items()}
    if torch.distributed.tensor.DTensor in {type(v) for v in state.values()}:
        state = {k: v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v for k, v in state.items()}
    again.bigfit.close()
    return whole, losses(again), state


def test_resume_and_save_model(tmp_path):
    """zero2 (FSDP2: DTensor parameters, the case Trainer's own loading and saving cannot take)."""
    from transformers import AutoModelForCausalLM

    whole, after, state = run_ranks(resumed, 1, tmp_path, "zero2")[0]
    assert after[-1] == pytest.approx(whole[-1], rel=1e-6)  # measured equal (0.0)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for k, v in saved.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    assert (tmp_path / "checkpoint-2" / "bigfit").is_dir() and (tmp_path / "checkpoint-4" / "optimizer.pt").is_file()


def refusal(out, where: str, value, settings: dict):
    import bigfit.hf
    from bigfit.errors import BigfitError
    from transformers import Trainer

    trainer = Trainer(model=tiny_model(), args=arguments(out), train_dataset=token_rows())
    if where:
        setattr(trainer.args, where, value)
    try:
        bigfit.hf.use(trainer, **settings)
    except BigfitError as e:
        return str(e)
    return None


@pytest.mark.parametrize("where,value,settings,words", [
    ("deepspeed", "ds_config.json", {}, "deepspeed="), ("fsdp", "full_shard", {}, "fsdp="),
    (None, None, {"strategy": "ddp", "tp": 2}, "tensor-parallel"), ("optim", "adafactor", {}, "optim='adafactor'")])
def test_mistakes_are_one_line(tmp_path, where, value, settings, words):
    message = run_ranks(refusal, 1, tmp_path, where, value, settings)[0]
    assert message and words in message and "\n" not in message, message


def example(name: str, out):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainer = module.main(["--output-dir", str(out), "--max-steps", "2"])
    trainer.bigfit.close()
    return losses(trainer)


@pytest.mark.parametrize("name", ["hf_trainer", "trl_sft", "trl_dpo"])
def test_examples_run(tmp_path, name):
    got = run_ranks(example, 1, name, tmp_path)[0]
    assert len(got) == 2 and all(torch.isfinite(torch.tensor(got)))
