"""The offload engine's compact optimizer states (--optimizer-states bf16 | int8, offload/statefmt.py):
the kernel against its plain-torch reference bit for bit, the formats' errors against fp32 Adam, the
bytes the planner counts, and training: 2 gloo ranks against one process in the same format on T5,
GPT-2 and Llama, the NVMe tier, exact resume, another world size, and a checkpoint converted into
another format."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAMILIES, read_jsonl

from bigfit.kernels import cpu_adam
from bigfit.offload import statefmt
from bigfit.offload.buckets import make_buckets
from bigfit.offload.stateref import BLOCK
from bigfit.settings.config import STATE_BYTES

needs_kernel = pytest.mark.skipif(cpu_adam.kernel() is None, reason="no C compiler here to build the kernel")


def _bucket(world: int = 2):
    """Rows of 300 (a block of 256 and one of 44), a 1-D parameter (a block per element), rows of 1000;
    on 2 ranks the last rank's rows are padded."""
    torch.manual_seed(0)
    params = [(n, torch.nn.Parameter(torch.randn(*shape))) for n, shape in
              (("a", (37, 300)), ("b", (53,)), ("c", (9, 1000)))]
    return make_buckets([params], world)[0]


def _states(fmt: str, b) -> dict:
    return {"step": torch.tensor(0.0), **statefmt.allocate(fmt, b, lambda kind, n, dtype: torch.zeros(n, dtype=dtype))}


def _run(fmt: str, cls, grad_dtype, use_kernel: bool, steps: int = 5, rank: int = 1):
    b = _bucket()
    torch.manual_seed(1)
    master = torch.randn(b.numel)
    inner = cls([master], lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    inner.state[master] = _states(fmt, b)
    for i in range(steps):
        grad = (torch.randn(b.numel) * 4 * (i + 1)).to(grad_dtype)
        statefmt.step(inner, master, grad, 4.0, b, rank, use_kernel)
    return master, inner.state[master]


@needs_kernel
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_its_reference_bit_for_bit(fmt, cls, grad_dtype):
    (p, st), (ref_p, ref_st) = _run(fmt, cls, grad_dtype, True), _run(fmt, cls, grad_dtype, False)
    assert torch.equal(p, ref_p)
    assert st.keys() == ref_st.keys() and all(torch.equal(st[k], ref_st[k]) for k in st)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_one_step_is_fp32_adams_and_the_stored_moments_round_within_their_format(fmt):
    """From zero moments the first step uses the fresh values, as fp32 Adam; what is stored then
    differs from fp32's moments by the format's rounding: bf16 one unit in the last place (2^-7
    relative), int8 half a code step: 1/16 of |m|, 1/32 of sqrt(v), and below 2^-14 of the block's
    largest value, where codes are evenly spaced, half their spacing (2^-18, 2^-19 of it)."""
    b = _bucket(world=1)
    torch.manual_seed(1)
    master = torch.randn(b.numel)
    fp32 = torch.optim.AdamW([master.clone()], lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, fused=True)
    (p32,) = fp32.param_groups[0]["params"]
    torch.manual_seed(7)
    grad = torch.randn(b.numel) * torch.logspace(-6, 0, b.numel)  # magnitudes over six decades
    p32.grad = grad.clone()
    fp32.step()
    inner = torch.optim.AdamW([master], lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    inner.state[master] = _states(fmt, b)
    statefmt.step(inner, master, grad, 1.0, b, 0, False)
    torch.testing.assert_close(master, p32, atol=1e-6, rtol=1e-6)
    m, v = statefmt.to_fp32(inner.state[master], b)
    m32, v32 = fp32.state[p32]["exp_avg"], fp32.state[p32]["exp_avg_sq"]
    if fmt == "bf16":
        assert ((m - m32).abs() <= m32.abs() * 2 ** -7).all() and ((v - v32).abs() <= v32 * 2 ** -7).all()
        return
    _within_a_code(m, m32, v, v32, b)


def _within_a_code(m, m32, v, v32, b) -> None:
    assert ((m - m32).abs() <= m32.abs() / 16 + _block_max(m32, b) * 2 ** -18).all()
    s, s32 = v.sqrt(), v32.sqrt()
    assert ((s - s32).abs() <= s32 / 32 + _block_max(s32, b) * 2 ** -19).all()


def _block_max(x: torch.Tensor, b) -> torch.Tensor:
    """Each element's block's largest magnitude (statefmt's blocks: 256 of a row)."""
    out = torch.zeros_like(x)
    for seg in statefmt.segments(b):
        rows = x[seg.offset:seg.offset + seg.rows * seg.row_numel].view(seg.rows, seg.row_numel)
        for j in range(seg.blocks):
            cols = slice(j * BLOCK, (j + 1) * BLOCK)
            top = rows[:, cols].abs().amax(1, keepdim=True)
            out[seg.offset:seg.offset + seg.rows * seg.row_numel].view(seg.rows, seg.row_numel)[:, cols] = top
    return out


def test_bf16s_second_moment_decays_as_fp32s():
    """With beta2 0.999 a step moves v by 0.1%, under half of bf16's spacing: rounded to nearest it
    would never decay. Stochastically rounded, 700 steps without gradient leave 0.999^700 of it."""
    b = make_buckets([[("w", torch.nn.Parameter(torch.zeros(64, 256)))]], 1)[0]
    master = torch.zeros(b.numel)
    inner = torch.optim.AdamW([master], lr=1e-3, betas=(0.9, 0.999))
    inner.state[master] = _states("bf16", b)
    statefmt.step(inner, master, torch.randn(b.numel), 1.0, b, 0, cpu_adam.kernel() is not None)
    first = inner.state[master]["exp_avg_sq"].float().clone()
    for _ in range(700):
        statefmt.step(inner, master, torch.zeros(b.numel), 1.0, b, 0, cpu_adam.kernel() is not None)
    ratio = inner.state[master]["exp_avg_sq"].float().sum() / first.sum()
    assert ratio == pytest.approx(0.999 ** 700, rel=0.01)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_the_bytes_are_those_the_planner_counts(fmt):
    """Rows of whole blocks: master (4) and moments, int8's scales included, as config.STATE_BYTES."""
    b = make_buckets([[("w", torch.nn.Parameter(torch.zeros(8, 1024)))]], 1)[0]
    held = sum(t.numel() * t.element_size() for t in statefmt.allocate(fmt, b, lambda k, n, d: torch.zeros(n, dtype=d))
               .values())
    assert (4 * b.numel + held) / b.numel == STATE_BYTES[fmt] == statefmt.bytes_per_parameter(fmt)


def test_int8_keeps_small_values_and_converts_back():
    b = _bucket(world=1)
    torch.manual_seed(3)
    m = torch.randn(b.numel) * torch.logspace(-4, 0, b.numel)
    v = m * m * 2
    st = _states("int8", b)
    statefmt.from_fp32(m, v, st, b)
    m8, v8 = statefmt.to_fp32(st, b)
    _within_a_code(m8, m, v8, v, b)
    assert (v8 > 0).all()  # sqrt(v) spans 4 decades: none flushed to zero


# -- training ---------------------------------------------------------------------------------------------
def job(model_dir, data, out, strategy: str, states: str, **kw):
    from bigfit.settings.config import TrainConfig

    # the NVMe tier: the first buckets' states in RAM (100 KB a rank: some of a tiny model's), the rest in files
    tier = dict(offload_grads="device", nvme_host_gb=1e-4) if strategy == "zero2-offload-nvme" else {}
    return TrainConfig(model=str(model_dir), data=str(data), output_dir=str(out), strategy=strategy, **tier,
                       optimizer_states=states, max_steps=4, batch_size=8, micro_batch_size=2, warmup_steps=0,
                       eval_every=0, eval_on_start=False, save_every=2, eval_samples=0, lr=3e-3, **kw)


CASES = [(f, "zero2-offload", "int8") for f in FAMILIES] + [("llama", "zero2-offload", "bf16"),
                                                          ("gpt2", "zero2-offload-nvme", "int8")]


def run_all(model_dirs, data, root, cases, suffix: str = "") -> None:
    from dist import train

    for family, strategy, states in cases:
        train(job(model_dirs[family], data, root / f"{family}-{strategy}-{states}{suffix}", strategy, states))


@pytest.fixture(scope="module")
def runs(model_dirs, pairs_file, tmp_path_factory):
    from dist import run_ranks, threads_per_rank, torch_threads

    root = tmp_path_factory.mktemp("states")
    references = [(f, "zero2-offload", s) for f, _, s in CASES if _ == "zero2-offload"]

    def meanwhile():
        with torch_threads(threads_per_rank(2)):
            run_all(model_dirs, pairs_file, root, references, "-1proc")
    run_ranks(run_all, 2, model_dirs, pairs_file, root, CASES, meanwhile=meanwhile)
    return root


# Worst seen (torch 2.13, this CPU): losses 0 apart, parameters 3.0e-8 (int8) and 1.5e-8 (bf16): the
# ranks' reduced gradients differ from one process's in their last bits, which may round a code the
# other way; an element's code one step off moves its weight by at most lr x 1/16 a step.
TOL = (1e-6, 2e-5)


@pytest.mark.parametrize("family,strategy,states", CASES)
def test_two_ranks_match_one_process_in_the_same_format(runs, family, strategy, states):
    ref = runs / f"{family}-zero2-offload-{states}-1proc"
    got = runs / f"{family}-{strategy}-{states}"
    ref_losses = [r["loss"] for r in read_jsonl(ref / "metrics.jsonl")]
    got_losses = [r["loss"] for r in read_jsonl(got / "metrics.jsonl")]
    assert len(ref_losses) == 4 and ref_losses[-1] < ref_losses[0]  # it trained
    assert max(abs(a - b) / a for a, b in zip(ref_losses, got_losses)) <= TOL[0], (got_losses, ref_losses)
    ref_params, got_params = (load_file(d / "model" / "model.safetensors") for d in (ref, got))
    worst = max((ref_params[k] - got_params[k]).abs().max().item() for k in ref_params)
    print(f"{family} {strategy} {states}: largest parameter difference {worst:.1e}")
    assert worst <= TOL[1]


def test_the_nvme_tier_keeps_int8_codes_and_scales_in_files(runs):
    files = sorted(p.name.split("-", 2)[2] for p in (runs / "gpt2-zero2-offload-nvme-int8" / "nvme" / "rank-0")
                   .glob("bucket-*"))
    assert set(files) == {"master.bin", "exp_avg.bin", "exp_avg_sq.bin", "exp_avg_scale.bin", "exp_avg_sq_scale.bin"}


def test_int8_resumes_exactly_at_one_process_and_converts_to_another_format(runs, model_dirs, pairs_file, capsys):
    """The 2-rank int8 checkpoint at step 2: one process resumes it (codes and scales resharded by
    rows) to the 2-rank run's losses; as bf16 states it is converted, said, and trains on; resumed
    with `--optimizer-states auto` it stays int8."""
    from dist import train

    whole = [r["loss"] for r in read_jsonl(runs / "llama-zero2-offload-int8" / "metrics.jsonl")]
    step2 = runs / "llama-zero2-offload-int8" / "checkpoints" / "step-00000002"
    for states in ("int8", "bf16"):
        out = runs / f"resumed-{states}"
        train(job(model_dirs["llama"], pairs_file, out, "zero2-offload", states, resume=str(step2)))
        resumed = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
        if states == "int8":
            assert resumed == pytest.approx(whole[2:], rel=1e-6)  # the order of fp32 sums alone differs
        else:
            assert "optimizer states: the checkpoint's are int8, this run keeps bf16: converted" in capsys.readouterr().out
            assert resumed == pytest.approx(whole[2:], rel=1e-3)
    # `bigfit train --resume` without --optimizer-states (auto) keeps the checkpoint's compact format
    from bigfit.settings.config import TrainConfig
    from bigfit.commands.decide import resumed_states as _resumed_states

    cfg = TrainConfig(strategy="zero2-offload", resume=str(step2), output_dir=str(runs / "resumed-auto"))
    assert _resumed_states(cfg).optimizer_states == "int8"


def test_a_strategy_with_fp32_states_refuses_an_int8_checkpoint_in_one_line(runs, model_dirs, pairs_file):
    from bigfit.errors import BigfitError
    from dist import train

    step2 = runs / "llama-zero2-offload-int8" / "checkpoints" / "step-00000002"
    with pytest.raises(BigfitError, match="its optimizer states are 8-bit .* resume with --strategy zero2-offload"):
        train(job(model_dirs["llama"], pairs_file, runs / "zero3-from-int8", "zero3", "fp32", resume=str(step2)))


# -- the planner --------------------------------------------------------------------------------------------
def _llama_11b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_hidden_layers=45, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)


def test_auto_takes_the_most_exact_format_that_fits_the_ram_and_says_why():
    """The 10.9B Llama on one H200 with 125 GiB of RAM: fp32 states (12 bytes a parameter) do not fit,
    so --strategy auto went to device_map and NVMe (25 s a step); with compact states zero2-offload
    fits, bf16 first. Named formats are rated as given."""
    from bigfit.machine.hardware import Hardware
    from bigfit.planning.search import Workload, plan_for_config

    hw = Hardware(gpu_bytes=(141 * 10**9,), cpu_ram=125 * 2**30, nvme=200 * 10**9)
    rated = {}
    for states in (None, "fp32", "int8"):
        job = Workload(batch_size=1, seq_len=2048, precision="bf16", checkpointing=True, optimizer_states=states,
                  nvme_host_gb=None)
        p = plan_for_config(_llama_11b(), hw, job, strategies=("zero2-offload", "zero2-offload-nvme", "device_map"))
        rated[states] = p, {c.estimate.name: c for c in p.candidates}
    p, by = rated[None]
    assert p.recommended == "zero2-offload" and by["zero2-offload"].estimate.states == "bf16"
    assert "with bf16 optimizer states (8 bytes a parameter" in p.reason and "with fp32 states it needs" in p.reason
    assert by["zero2-offload-nvme"].estimate.states == "fp32"  # fp32 fits there: its disk holds the rest
    _, fp32 = rated["fp32"]
    assert not fp32["zero2-offload"].fits and "host RAM" in fp32["zero2-offload"].why_not
    _, int8 = rated["int8"]
    host = {s: c["zero2-offload"].estimate.per_host["optimizer"] for s, c in (("bf16", by), ("int8", int8))}
    assert host["int8"] / host["bf16"] == pytest.approx(STATE_BYTES["int8"] / STATE_BYTES["bf16"])
    # fewer host bytes, but more work a byte: int8's step is slower than bf16's (estimate.FORMAT_SPEED)
    assert int8["zero2-offload"].estimate.costs["cpu_optimizer"] > by["zero2-offload"].estimate.costs["cpu_optimizer"]
    # this host's rates where they were measured (bigfit plan --calibrate): here int8 at half bf16's
    slow = plan_for_config(_llama_11b(), replace(hw, host_adam_rates=(("bf16", 2e9), ("int8", 1e9))), job,
                           strategies=("zero2-offload",)).candidates[0].estimate
    assert slow.costs["cpu_optimizer"] == pytest.approx(10.866, rel=1e-3)  # 10.866B parameters at 1 G/s


def test_strategy_auto_hands_the_format_it_rated_to_the_run(model_dirs, monkeypatch):
    """The launcher's decision carries the format (the workers never see "auto"); a named strategy
    keeps fp32; a compact format with a strategy that keeps fp32 states is one line."""
    from bigfit.job.checks import validate
    from bigfit.settings.config import TrainConfig
    from bigfit.errors import BigfitError
    from bigfit.job import autoplan as planner
    from bigfit.job.resolution import resolve
    from bigfit.commands import decide

    monkeypatch.setattr(planner, "auto_plan", lambda cfg, world, one, lengths: ("zero2-offload", {"dp_shard": 1}, "planned"))
    monkeypatch.setattr(planner, "optimizer_states", lambda cfg, world, name, lengths: "int8")
    cfg = decide.auto_strategy(TrainConfig(model=str(model_dirs["llama"]), strategy="auto", nproc=1), None)
    assert (cfg.strategy, cfg.optimizer_states) == ("zero2-offload", "int8")
    assert resolve(TrainConfig(strategy="zero2-offload", batch_size=4), 1).cfg.optimizer_states == "fp32"
    with pytest.raises(BigfitError, match="--optimizer-states int8 belongs to --strategy zero2-offload"):
        validate(TrainConfig(strategy="zero3", optimizer_states="int8", batch_size=4))
    with pytest.raises(BigfitError, match="--optimizer-states 'fp8' is not valid; choose one of: fp32, bf16, int8, auto"):
        validate(TrainConfig(strategy="zero2-offload", optimizer_states="fp8", batch_size=4))
