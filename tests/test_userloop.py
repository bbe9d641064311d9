"""bigfit.prepare in a loop of the user's own: the same losses as `bigfit train` on the same data and
seed, strategy by strategy, on gloo ranks (fp32); checkpoints it saves load at another process count
and resume exactly; each mistake one line before any work.

The user's loop here computes bigfit train's loss itself (summed token loss over the global batch's
target tokens, times the data-parallel ranks that the engines average over) on the batches bigfit
train takes (its Batcher), so the two must agree to the order of floating-point sums."""
from __future__ import annotations

import pytest
import torch

from conftest import read_jsonl
from dist import release, run_ranks, train


@pytest.fixture(scope="module", autouse=True)
def _ranks_ended_after():
    """This file's calls end their kept ranks with it (tests/dist.py release): its prepare() calls leave
    the gloo groups of their meshes in them (a later file's collectives would share the cores with their
    polling threads)."""
    yield
    release(1, 2, 4)


# (strategy, processes, family, extra settings). LoRA on zero2 and on one process; tensor parallel on
# Llama (GPT-2's Conv1D is not split), alone and under FSDP2 (4 ranks); HSDP (2 replicas of 2 shards);
# the device map is one process.
LORA = {"lora": True, "lora_dropout": 0.0}  # dropout draws differ between one process and several
CASES = [("single", 1, "t5", {}), ("device_map", 1, "gpt2", {}), ("single", 1, "llama", LORA),
         ("ddp", 2, "gpt2", {}), ("zero1", 2, "llama", {}), ("zero2", 2, "t5", {}), ("zero3", 2, "llama", {}),
         ("zero2-offload", 2, "gpt2", {}), ("zero3-offload", 2, "t5", {}), ("ddp", 2, "llama", {"tp": 2, "sequence_parallel": True}),
         ("zero2", 2, "gpt2", LORA), ("zero3", 4, "llama", {"tp": 2}), ("zero3", 4, "gpt2", {"dp_replicate": 2})]
STEPS = 3
# relative loss difference against bigfit train on one process: the same sums in another order (bigfit
# train's loss summed on the device in float64, the user's here per micro-batch; gradients reduced over
# ranks); test_parity.py's fp32 tolerance for bigfit train's own strategies is 1e-6, and this adds its own
TOL = 2e-6


def settings(strategy: str, extra: dict) -> dict:
    return dict(strategy=strategy, precision="fp32", max_steps=STEPS, batch_size=8, micro_batch_size=2,
                warmup_steps=0, seed=0, **extra)


def reference(model_dir, data, out, strategy, extra):
    from bigfit.settings.config import TrainConfig

    train(TrainConfig(model=str(model_dir), data=str(data), output_dir=str(out), eval_every=0, eval_on_start=False,
                      eval_samples=0, save_every=0, checkpoints=False, **settings(strategy, extra)))


def own_loop(model_dir, data, strategy, extra, save=None, load=None, steps=STEPS):
    """The user's loop: bigfit train's batches, its loss computed here. Returns each step's loss."""
    import bigfit
    from bigfit.data import Batcher, collate
    from bigfit.engine.losses import model_logits, sample_targets, token_loss
    from bigfit.common.distributed import all_reduce_sum

    ready = _dataset(model_dir, data, strategy, extra)
    engine = bigfit.prepare(str(model_dir), **settings(strategy, extra))
    start = engine.load(load)["step"] if load else 0
    ds, seq2seq, data_rt = ready.dataset, ready.seq2seq, engine.rt.data
    batcher, losses = Batcher(len(ds.train), 8, 0), []
    for step in range(start, steps):
        total = sum(sample_targets(ds.train[i], seq2seq) for i in batcher.global_batch(step))
        local = 0.0
        for mb in batcher.micro_batches(step, data_rt.rank, data_rt.world_size, 2):
            batch = {k: v.to(engine.device) for k, v in collate([ds.train[i] for i in mb], ds.pad_id).items()}
            summed = token_loss(model_logits(engine.model, engine.module, batch, seq2seq), batch["labels"], seq2seq)
            engine.backward(summed * data_rt.world_size / total, scale_by_accumulation=False)
            engine.step()
            local += summed.item() if engine.engine.counts else 0.0
        losses.append(all_reduce_sum([local], engine.rt)[0] / total)
    path = engine.save(save) if save else None
    engine.close()
    return losses, path


def _dataset(model_dir, data, strategy, extra):
    from bigfit.job.prepare import prepare
    from bigfit.job.resolution import resolve
    from bigfit.settings.config import TrainConfig

    return prepare(resolve(TrainConfig(model=str(model_dir), data=str(data), eval_samples=0, **settings("single", {})), 1))


def own_losses(model_dir, data, strategy, extra):
    return own_loop(model_dir, data, strategy, extra)[0]


@pytest.fixture(scope="module")
def bigfit_train_losses(model_dirs, pairs_file, tmp_path_factory):
    """bigfit train's losses on one process, per (family, LoRA), made once: test_parity.py holds every
    strategy of bigfit train to them (fp32: 1e-6 relative), so a loop through prepare that matches them
    matches bigfit train under its own strategy."""
    made = {}

    def losses(family: str, lora: bool) -> list[float]:
        if (family, lora) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{int(lora)}") / "run"
            run_ranks(reference, 1, model_dirs[family], pairs_file, out, "single", LORA if lora else {})
            made[family, lora] = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
        return made[family, lora]
    return losses


@pytest.mark.parametrize("strategy,world,family,extra", CASES,
                         ids=[f"{s}-{f}" + "".join(f"-{k}" for k in e if k != "lora_dropout") for s, _, f, e in CASES])
def test_own_loop_matches_bigfit_train(model_dirs, pairs_file, bigfit_train_losses, strategy, world, family, extra):
    mine = run_ranks(own_losses, world, model_dirs[family], pairs_file, strategy, extra)[0]
    theirs = bigfit_train_losses(family, bool(extra.get("lora")))
    assert len(mine) == len(theirs) == STEPS
    for a, b in zip(mine, theirs):
        assert abs(a - b) <= TOL * abs(b), (mine, theirs)


def test_saved_at_two_processes_resumes_at_one(model_dirs, pairs_file, tmp_path):
    """zero2 on 2 ranks saves after 2 steps; one process (single) loads it and takes step 3: the loss
    of an uninterrupted run's step 3 (DCP reshards by parameter name)."""
    whole = run_ranks(own_loop, 2, model_dirs["llama"], pairs_file, "zero2", {})[0][0]
    _, path = run_ranks(own_loop, 2, model_dirs["llama"], pairs_file, "zero2", {}, tmp_path / "ck", None, 2)[0]
    resumed = run_ranks(own_loop, 1, model_dirs["llama"], pairs_file, "single", {}, None, path)[0][0]
    assert resumed[0] == pytest.approx(whole[2], rel=1e-6)


def test_mistakes_are_one_line_before_any_work(model_dirs):
    import bigfit
    from bigfit.errors import BigfitError
    from tiny import twin_models

    model, _ = twin_models("llama")
    cases = [((42,), {}, "model must be a torch.nn.Module"),
             ((model,), {"strategy": "zero9"}, "strategy"),
             ((model,), {"learning_rate": 1e-4}, "unknown setting"),
             ((model,), {"lr": "fast"}, "lr"),
             ((model,), {"data": "x.jsonl"}, "data= is bigfit train's"),
             ((torch.nn.DataParallel(model),), {}, "already wrapped by DataParallel"),
             ((type("DeepSpeedEngine", (torch.nn.Module,), {})(),), {}, "already wrapped by DeepSpeed"),
             ((model,), {"strategy": "auto"}, "pass sample="),
             ((model,), {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "strategy": "zero2-offload"},
              "builds its own optimizer"),
             ((model,), {"strategy": "zero2-offload", "delayed_update": "yes"}, "delayed")]
    for args, kw, words in cases:
        with pytest.raises(BigfitError, match=words) as e:
            bigfit.prepare(*args, **kw)
        assert "\n" not in str(e.value)


def test_step_before_backward_is_one_line():
    import bigfit
    from bigfit.errors import BigfitError
    from tiny import twin_models

    model, _ = twin_models("gpt2")
    with bigfit.prepare(model, precision="fp32") as engine:
        with pytest.raises(BigfitError, match="before engine.backward"):
            engine.step()
        with pytest.raises(BigfitError, match="requires grad"):
            engine.backward(torch.tensor(1.0))
        x = torch.randint(2, 300, (2, 8))
        engine.backward(engine.model(input_ids=x, labels=x).loss)
        engine.step()
        assert engine.global_step == 1 and engine.grad_norm > 0


def test_auto_picks_what_bigfit_train_picks(model_dirs):
    """strategy="auto" rates the sample batch as bigfit train rates its data's longest batch: the same pick."""
    import dataclasses

    import bigfit
    from bigfit.commands.decide import auto_strategy
    from bigfit.settings.config import TrainConfig

    ids = torch.zeros(4, 96, dtype=torch.long)
    with bigfit.prepare(str(model_dirs["llama"]), strategy="auto", sample={"input_ids": ids, "labels": ids}) as engine:
        picked = engine.plan["strategy"]
    cfg = TrainConfig(model=str(model_dirs["llama"]), strategy="auto", batch_size=4, micro_batch_size=4, nproc=1)
    assert picked == auto_strategy(dataclasses.replace(cfg, nproc=None), (96, 96), processes=1, one_process=True).strategy


# accelerate launch --multi_gpu runs torchrun's launcher (torch.distributed.run) with accelerate's environment
# on top: one run covers both. Without GPUs accelerate starts several processes only with --multi_gpu.
LAUNCHERS = {"accelerate": ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
                            "1", "--mixed_precision", "no", "--dynamo_backend", "no"]}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_own_loop_example_under_launchers(tmp_path, launcher):
    """examples/own_loop.py as a user runs it: accelerate launch (torchrun inside), 2 processes, zero2 (its loss its own)."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "own_loop.py"
    out = subprocess.run([sys.executable, *LAUNCHERS[launcher], str(example), "--strategy", "zero2", "--steps", "2"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FSDP2 over" in out.stdout and "step 2: loss" in out.stdout


def mean_loss(logits, labels):
    """A user's loss: the mean next-token cross-entropy of the batch (its padded positions -100)."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def through_loss_fn(model_dir, strategy, extra):
    """engine.forward_backward with prepare's loss_fn, 3 steps of 2 micro-batches of 4 rows: each rank's
    losses (a pipeline's last stage holds them)."""
    import bigfit

    g = torch.Generator().manual_seed(0)
    data = torch.randint(3, 380, (24, 16), generator=g)
    engine = bigfit.prepare(str(model_dir), strategy=strategy, precision="fp32", batch_size=8, micro_batch_size=4,
                            max_steps=3, warmup_steps=0, seed=0, loss_fn=mean_loss, **extra)
    losses = []
    for step in range(3):
        total = 0.0
        for micro in range(2):
            ids = data[step * 8 + micro * 4: step * 8 + micro * 4 + 4]
            total += engine.forward_backward({"input_ids": ids, "labels": ids}).item() / 2
            engine.step()
        losses.append(total)
    engine.close()
    return losses


def test_pipeline_takes_the_users_loss(model_dirs):
    """Pipeline stages (2 ranks, the loss inside torch's schedule, 2 chunks) give the losses of one
    process running the same loss_fn; without loss_fn they are refused in one line."""
    one = run_ranks(through_loss_fn, 1, model_dirs["llama"], "single", {})[0]
    stages = run_ranks(through_loss_fn, 2, model_dirs["llama"], "pipeline", {"chunks": 2})[1]  # the last stage
    assert stages == pytest.approx(one, rel=1e-6)
    said = run_ranks(_pipeline_without_loss, 2, model_dirs["llama"])  # caught on the ranks: their pool is kept
    assert all("pass loss_fn=" in line and "\n" not in line for line in said), said


def _pipeline_without_loss(model_dir) -> str:
    import bigfit
    from bigfit.errors import BigfitError

    try:
        bigfit.prepare(str(model_dir), strategy="pipeline", micro_batch_size=2, chunks=2)
    except BigfitError as e:
        return str(e)
    return "no error"


def test_users_own_optimizer_keeps_its_lr():
    """optimizer= (single, ddp): the user's optimizer steps the model, at its own lr (bigfit sets none),
    after bigfit's clipping: the same parameters as the plain loop's."""
    import bigfit
    from tiny import twin_models

    model, twin = twin_models("gpt2")
    x = torch.randint(2, 300, (2, 8))
    with bigfit.prepare(model, strategy="single", precision="fp32", max_grad_norm=0.0,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.5)) as engine:
        engine.backward(engine.model(input_ids=x, labels=x).loss)
        engine.step()
        assert engine.engine.optimizer.param_groups[0]["lr"] == 0.5
    plain = torch.optim.SGD(twin.parameters(), lr=0.5)
    twin(input_ids=x, labels=x).loss.backward()
    plain.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
