"""fp16 loss scaling in a real run, DeepSpeed-config and "auto" settings through the command line."""
from __future__ import annotations

import json

import pytest
import torch

from bigfit.cli import config_from_args, parse_args
from bigfit.errors import BigfitError
from conftest import read_jsonl
from tiny import Stack


def small(model_dir, data, out, **kw):
    from bigfit.settings.config import TrainConfig

    settings = dict(strategy="single", max_steps=4, batch_size=4, eval_samples=0, save_every=0, consolidate=False)
    return TrainConfig(model=str(model_dir), data=str(data), output_dir=str(out), **{**settings, **kw})


def test_fp16_overflow_steps_are_skipped_counted_and_logged(model_dirs, pairs_file, tmp_path, capsys):
    from dist import train

    # 2**120 overflows fp16 gradients on every step; the scale may not go lower, so every step is skipped
    cfg = small(model_dirs["llama"], pairs_file, tmp_path, precision="fp16", initial_scale_power=120,
                min_loss_scale=2.0 ** 120)
    train(cfg)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["overflow"] for r in records] == [True] * 4
    assert [r["skipped_steps"] for r in records] == [1, 2, 3, 4]
    assert all(r["loss_scale"] == 2.0 ** 120 for r in records)
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "fp16 gradients overflowed at loss scale" in out
    assert "sits at its minimum" in out and "use --precision bf16" in out


@pytest.mark.parametrize("strategy", ["single", "zero2-offload"])  # autocast; the offload engine's own skip
def test_fp16_dynamic_scale_backs_off_then_trains(model_dirs, pairs_file, tmp_path, strategy):
    from dist import train

    train(small(model_dirs["gpt2"], pairs_file, tmp_path, precision="fp16", initial_scale_power=24, hysteresis=1,
                max_steps=30, strategy=strategy))
    records = read_jsonl(tmp_path / "metrics.jsonl")
    scales = [r["loss_scale"] for r in records]
    assert records[0]["overflow"] and scales[1] == scales[0] / 2  # halved after each overflow
    assert not records[-1]["overflow"] and scales[-1] < 2.0 ** 24  # found a scale that fits
    assert records[-1]["skipped_steps"] == sum(r["overflow"] for r in records)


def test_fp16_on_t5_warns_before_training(model_dirs, pairs_file, tmp_path, capsys):
    from dist import train

    train(small(model_dirs["t5"], pairs_file, tmp_path, precision="fp16", max_steps=1))
    assert "t5 models are usually pretrained in bf16" in " ".join(capsys.readouterr().out.split())


def test_deepspeed_config_on_the_command_line(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": "auto",
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                              "overlap_comm": True},
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "weight_decay": 0.1}},
        "gradient_clipping": 0.5, "wall_clock_breakdown": False}))
    cfg = config_from_args(parse_args(["train", "--deepspeed-config", str(ds), "--nproc", "2", "--lr", "0.01"]))
    assert (cfg.strategy, cfg.precision, cfg.initial_scale_power, cfg.loss_scale) == ("zero3-offload", "fp16", 8, 0)
    assert (cfg.batch_size, cfg.micro_batch_size, cfg.optimizer) == (16, 2, "adamw")  # DeepSpeed's Adam is AdamW
    assert (cfg.weight_decay, cfg.max_grad_norm, cfg.lr) == (0.1, 0.5, 0.01)  # the flag wins over "auto"
    out = capsys.readouterr().out
    assert "-> strategy zero3-offload, precision fp16" in out
    assert "ignored: wall_clock_breakdown" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}))
    with pytest.raises(BigfitError, match="offload_param"):
        config_from_args(parse_args(["train", "--deepspeed-config", str(bad)]))


def test_auto_values_in_files_and_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("micro_batch_size: auto\nprecision: auto\nnproc: auto\n")
    cfg = config_from_args(parse_args(["train", "--config", str(f)]))
    assert (cfg.micro_batch_size, cfg.precision, cfg.nproc) == ("auto", None, None)  # planned vs derived
    cfg = config_from_args(parse_args(["train", "--precision", "auto"]))
    from bigfit.job.resolution import resolve

    resolved = resolve(cfg, 2).cfg
    assert resolved.micro_batch_size == 16 and resolved.precision == "fp32"  # no bf16-capable GPU here
    with pytest.raises(BigfitError, match="planned before the job is resolved"):
        resolve(config_from_args(parse_args(["train", "--micro-batch-size", "auto"])), 2)
    f.write_text("max_steps: auto\n")
    with pytest.raises(BigfitError, match="max_steps cannot be 'auto'"):
        config_from_args(parse_args(["train", "--config", str(f)]))


def test_strategy_auto_plans_then_trains(model_dirs, pairs_file, tmp_path, capsys):
    from bigfit.cli import main

    assert main(["train", "--strategy", "auto", "--nproc", "1", "--model", str(model_dirs["llama"]), "--data",
                 str(pairs_file), "--max-steps", "2", "--batch-size", "4", "--eval-samples", "0",
                 "--output-dir", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--strategy auto -> " in out and "is the fastest that fits" in out
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2


def test_micro_batch_auto_steps_down_after_out_of_memory(model_dirs, pairs_file, tmp_path, capsys, monkeypatch):
    from bigfit.cli import main

    monkeypatch.setenv("BIGFIT_FAULT", "oom-above:4")  # read by the probe processes, which inherit it
    # the probes are processes of their own; the job itself (one process) trains in this one
    code = main(["train", "--model", str(model_dirs["gpt2"]), "--data", str(pairs_file), "--strategy", "single",
                 "--batch-size", "16", "--micro-batch-size", "auto", "--max-steps", "2", "--eval-samples", "0",
                 "--output-dir", str(tmp_path)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "probe micro-batch 16: out of memory" in printed.out and "probe micro-batch 8: out of memory" in printed.out
    out = " ".join(printed.out.split())
    # a fixed batch takes divisors of it: 16 fails, then down by a step doubling each probe: 8 fails, 4 runs
    assert "micro-batch auto -> 4: predicted 16 (" in out and "probes 16 OOM, 8 OOM, 4 ok; confirmed 4 (peak" in out
    assert "global 16 = 1 data-parallel x 4 accumulation x micro-batch 4" in out
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2


def test_keep_checkpoints_rotates_the_oldest(model_dirs, pairs_file, tmp_path):
    from dist import train

    train(small(model_dirs["llama"], pairs_file, tmp_path, max_steps=6, save_every=2, keep_checkpoints=2))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000006"]


@pytest.mark.parametrize("step", ["kernel", "torch"])
@pytest.mark.parametrize("grads", ["host", "device"])
@pytest.mark.parametrize("mode", ["after-backward", "delayed", "eager"])
def test_host_optimizer_is_adamw_and_the_delayed_one_lags_exactly_one_step(mode, grads, step, monkeypatch):
    """The offload engine's host step gives torch AdamW's iterates (bit-equal with torch's fused step;
    bigfit's kernel, cpu_adam.py, rounds differently: to 1e-6, where a lag would differ by lr = 0.1
    per step), whether it starts after backward
    or (eager: no clipping, no loss scale) during it, and whether gradients wait in host buffers or on
    the device (copied down through the slots just before their step). Delayed (documented
    semantics): the forward and backward of step t (1-based) use the parameters after update t-2 (the
    initial ones for t = 1, 2); each gradient is applied to the latest master weights."""
    from bigfit.common.distributed import Runtime
    from bigfit.kernels import cpu_adam
    from bigfit.offload.strategy import apply_offload

    if step == "torch":
        monkeypatch.setattr(cpu_adam, "supports", lambda inner: False)
    elif cpu_adam.kernel() is None:
        pytest.skip("no C compiler here to build bigfit's CPU Adam kernel")
    tol = {"atol": 1e-6, "rtol": 1e-6} if step == "kernel" else {"atol": 0.0, "rtol": 0.0}
    torch.manual_seed(0)
    model = Stack()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, used, grads = torch.randn(8, 4), [], []
    for n, p in model.named_parameters():  # registered first: runs before the engine takes the gradient
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads[-1].__setitem__(n, p.grad.clone()))
    delayed = mode == "delayed"
    applied = apply_offload(model, "zero2-offload", Runtime(0, 1, 0, torch.device("cpu")), None, delayed=delayed,
                            nvme_dir=None, eager=mode == "eager", grads_on_device=grads == "device")
    assert (applied.engine.slots is not None) == (grads == "device") and len(applied.engine.buckets) == 5
    applied.attach_optimizer(torch.optim.AdamW, lr=0.1, fused=True)
    opt = applied.engine
    assert opt.kernel == (step == "kernel")
    # the host step runs beside the next forward: what a step uses is seen inside it, once the engine
    # has waited for every bucket (the head's is the last)
    model.head.register_forward_pre_hook(lambda *_: used.append({n: p.detach().clone() for n, p in model.named_parameters()}))
    for _ in range(5):
        grads.append({})
        model(x).pow(2).sum().backward()
        opt.clip_and_step(0.0)
    opt.flush()
    ref = Stack()
    ref.load_state_dict(start)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, fused=True)
    iterates = [start]
    for g in grads:  # plain AdamW on the very gradients the delayed run computed
        for n, p in ref.named_parameters():
            p.grad = g[n]
        ref_opt.step()
        iterates.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    for t, params in enumerate(used):
        expected = iterates[max(t - 1, 0) if delayed else t]
        for n in params:
            torch.testing.assert_close(params[n], expected[n], **tol, msg=lambda m: f"step {t + 1}, {n}: {m}")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), iterates[5][n], **tol)


def test_offload_engine_leaves_frozen_parameters_alone():
    import torch

    from bigfit.common.distributed import Runtime
    from bigfit.offload.strategy import apply_offload

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    applied = apply_offload(model, "zero2-offload", Runtime(0, 1, 0, torch.device("cpu")), torch.bfloat16,
                            delayed=False, nvme_dir=None)
    applied.attach_optimizer(torch.optim.AdamW, lr=0.1, fused=True)
    opt = applied.engine
    before = model[1].weight.detach().clone()
    for _ in range(2):
        model(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        opt.clip_and_step(1.0)
    opt.flush()
    assert model[0].weight.dtype == torch.bfloat16 and torch.equal(model[0].weight, frozen.to(torch.bfloat16))
    assert not torch.equal(model[1].weight, before.to(torch.bfloat16))  # the trainable one moved


def test_delayed_update_trains_through_the_loop(model_dirs, pairs_file, tmp_path):
    from dist import train

    train(small(model_dirs["llama"], pairs_file, tmp_path, strategy="zero2-offload", delayed_update=True,
                max_steps=6, save_every=3))
    losses = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert len(losses) == 6 and losses[-1] < losses[0]
    with pytest.raises(BigfitError, match="--delayed-update needs --strategy zero2-offload"):
        config_from_args(parse_args(["train", "--delayed-update", "--strategy", "zero3"]))
