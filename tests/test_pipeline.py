"""`--strategy pipeline` on 2 gloo ranks against the single-process reference, through the real training
loop: same global batch, data and seed; GPT-2 (tied wte/lm_head on different ranks), a Llama-style
model (RoPE, GQA) and T5 (tied embeddings on both ranks, 2 encoder + 3 decoder blocks), with GPipe,
1F1B and interleaved 1F1B (2 ranks x 2 stages); fp32, bf16, fp16; gradient accumulation; clipping;
held-out loss; resume from a pipeline checkpoint; consolidation to a full model. All pipeline jobs
run in one launch (a 2-rank launch costs ~10 s of imports on this machine).

Tolerances (printed with -s) against the worst differences measured on torch 2.13, CPU. fp32: the runs
differ only in the order of fp32 sums (worst seen: loss 1.2e-7 relative, parameters 5e-6; from bigfit's
per-block seeded init, one element of T5's decoder.block.0 q at 5.4e-5, its gradient within rounding
of zero in AdamW's first steps, as below, every other one under 4e-6). bf16:
autocast rounds per chunk of 2 rows against the reference's whole micro-batches, and padded lengths
change the bf16 matmul shapes; an element whose gradient is near zero can then flip sign, and AdamW
moves it by up to 2 x lr per step the other way (bound over 3 steps at lr 3e-3: 1.8e-2; worst seen:
loss 2.2e-5 relative, parameters 5.7e-3). fp16 (static loss scale 1024), likewise: loss 1.4e-6,
parameters 3.2e-3. The Llama GPipe job also checkpoints its blocks' activations.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, LlamaConfig, T5Config

from conftest import read_jsonl
from dist import run_ranks, threads_per_rank, torch_threads

TOL = {"fp32": (1e-6, 2e-4), "bf16": (5e-4, 3e-2), "fp16": (2e-5, 3e-2)}
STEPS = 3
# (model, precision, schedule, micro-batch): each a pipeline job on 2 ranks, 2 chunks per micro-batch.
# The cuts: GPT-2 and Llama 2 + 2 blocks (interleaved: 1 per stage); T5 2 + 3 puts the encoder and the
# first decoder block on rank 0 (it sends the decoder's hidden state and bias with the encoder output);
# T5 3 + 2 interleaved: enc.0 | enc.1-2 | dec.0 | dec.1 (a stage starting inside the encoder, one ending
# with it, the shared embedding used on rank 0 by both stacks and tied to the head on rank 1).
CASES = [("gpt2", "fp32", "gpipe", 8), ("gpt2", "fp32", "1f1b", 4), ("llama", "fp32", "gpipe", 4),
         ("llama", "fp32", "1f1b", 8), ("gpt2", "fp32", "interleaved", 8), ("t5", "fp32", "1f1b", 4),
         ("t5-3+2", "fp32", "interleaved", 8), ("llama", "bf16", "1f1b", 8), ("gpt2", "fp16", "gpipe", 4)]


def t5(encoder: int, decoder: int) -> T5Config:
    return T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=encoder, num_decoder_layers=decoder,
                    num_heads=4, dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0,
                    eos_token_id=1)


def configs():
    """Deep enough for 4 stages; the tiny conftest models have 2 blocks."""
    return {
        "gpt2": GPT2Config(vocab_size=384, n_embd=32, n_layer=4, n_head=2, n_positions=256, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=1),
        "llama": LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1),
        "t5": t5(2, 3),
        "t5-3+2": t5(3, 2),
    }


def job(model_dir, data, out, strategy, precision="fp32", **kw):
    from bigfit.settings.config import TrainConfig

    values = dict(model=str(model_dir), data=str(data), output_dir=str(out), strategy=strategy, precision=precision,
                  max_steps=STEPS, batch_size=8, micro_batch_size=4, warmup_steps=0, eval_every=0, save_every=0,
                  eval_on_start=False, eval_samples=4, num_beams=2, max_new_tokens=4, lr=3e-3, loss_scale=1024.0 if precision == "fp16" else 0.0)
    return TrainConfig(**{**values, **kw})


def pipeline_jobs(dirs, data, root) -> list:
    out = []
    for family, precision, schedule, micro in CASES:
        kw = dict(pipeline_schedule=schedule, chunks=2, micro_batch_size=micro)
        if (family, schedule) == ("gpt2", "1f1b"):
            kw["save_every"] = 2  # resumed below
        if (family, schedule) == ("llama", "gpipe"):
            kw["activation_checkpointing"] = True  # after the split, on this rank's blocks: same results
        out.append(job(dirs[family], data, root / f"{family}-{precision}-{schedule}", "pipeline", precision, **kw))
    # from the 1F1B GPT-2 run's step-2 checkpoint to the end, in a fresh output directory
    resume = root / "gpt2-fp32-1f1b" / "checkpoints" / "step-00000002"
    out.append(job(dirs["gpt2"], data, root / "resumed", "pipeline", pipeline_schedule="1f1b", chunks=2,
                   resume=str(resume)))
    return out


def train_all(jobs) -> None:
    from dist import train

    for cfg in jobs:
        train(cfg)


@pytest.fixture(scope="module")
def runs(pairs_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    dirs = {}
    for family, config in configs().items():
        config.save_pretrained(root / family)
        dirs[family] = root / family
    references = [job(dirs[family], pairs_file, root / f"{family}-{precision}-single", "single", precision)
                  for family, precision in sorted({(f, p) for f, p, _, _ in CASES})]

    def run_references():
        with torch_threads(threads_per_rank(2)):  # the references compute as each rank does
            train_all(references)

    # all pipeline jobs in one launch; the single-process references run here meanwhile
    run_ranks(train_all, 2, pipeline_jobs(dirs, pairs_file, root), meanwhile=run_references)
    return root


def compare(ref, got, tol, label: str) -> None:
    ref_losses = [r["loss"] for r in read_jsonl(ref / "metrics.jsonl")]
    got_losses = [r["loss"] for r in read_jsonl(got / "metrics.jsonl")]
    assert len(got_losses) == STEPS and ref_losses[-1] < ref_losses[0]  # it trained
    ref_params = load_file(ref / "model" / "model.safetensors")
    got_params = load_file(got / "model" / "model.safetensors")
    assert ref_params.keys() == got_params.keys()  # consolidated from the stages' checkpoints: the full model
    loss_diff = max(abs(a - b) / a for a, b in zip(ref_losses, got_losses))
    worst = max((ref_params[k] - got_params[k]).abs().max().item() for k in ref_params)
    print(f"{label}: max loss rel diff {loss_diff:.1e}, max param diff {worst:.1e}")
    assert loss_diff <= tol[0], f"losses {got_losses} vs {ref_losses}"
    assert worst <= tol[1], f"largest parameter difference {worst:.2e}"


@pytest.mark.parametrize("family,precision,schedule,micro", CASES)
def test_matches_single_process(runs, family, precision, schedule, micro):
    ref, got = runs / f"{family}-{precision}-single", runs / f"{family}-{precision}-{schedule}"
    compare(ref, got, TOL[precision], f"{family} {precision} {schedule} micro {micro}")
    ref_eval, got_eval = read_jsonl(ref / "eval.jsonl")[-1], read_jsonl(got / "eval.jsonl")[-1]
    assert got_eval["eval_loss"] == pytest.approx(ref_eval["eval_loss"], rel=TOL[precision][0])
    if family.startswith("t5"):
        assert "eval_bleu" not in got_eval  # generate() is left to the consolidated model


@pytest.mark.parametrize("run,names", [("gpt2-fp32-1f1b", ("transformer.wte.weight", "lm_head.weight")),
                                       ("gpt2-fp32-interleaved", ("transformer.wte.weight", "lm_head.weight")),
                                       ("t5-fp32-1f1b", ("shared.weight", "lm_head.weight")),
                                       ("t5-3+2-fp32-interleaved", ("shared.weight", "lm_head.weight"))])
def test_tied_copies_on_two_ranks_stay_equal(runs, run, names):
    """Each rank checkpoints its own copy under its own name; after training they are identical."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = runs / run / "checkpoints" / f"step-{STEPS:08d}"
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    copies = {n: torch.empty(meta[f"model.{n}"].size) for n in names}
    with warnings.catch_warnings():  # "no process group: loading in one process" is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({f"model.{n}": t for n, t in copies.items()}, checkpoint_id=str(ckpt), no_dist=True)
    first, second = copies.values()
    assert torch.equal(first, second)


def test_resume_continues_exactly(runs):
    whole = read_jsonl(runs / "gpt2-fp32-1f1b" / "metrics.jsonl")
    resumed = read_jsonl(runs / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["loss"] == whole[2]["loss"]  # bit for bit
    a, b = (load_file(runs / d / "model" / "model.safetensors") for d in ("gpt2-fp32-1f1b", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- no processes: the cut, pruning, and mistakes caught before any work -------------------------------

def test_balance_cuts_contiguous_runs_by_size():
    from bigfit.pipeline import balance

    assert balance([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balance([2, 2, 3, 3, 3], 2) == [(0, 3), (3, 5)]  # T5-like: decoder blocks weigh more
    assert balance([5, 1, 1, 1, 1, 1], 3) == [(0, 1), (1, 3), (3, 6)]  # then as even as it gets
    assert balance([1, 1], 2) == [(0, 1), (1, 2)]


def test_pruning_keeps_original_names():
    from transformers import AutoModelForCausalLM

    from bigfit.layout.cut import PipelineLayout
    from bigfit.layout.split import plan_split, prune, tied_groups

    full = AutoModelForCausalLM.from_config(configs()["gpt2"])
    names = set(full.state_dict())
    layout = PipelineLayout(world=2, stages_per_rank=2, schedule="interleaved", chunks=2)
    split = plan_split(full, layout)
    assert split.runs == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert tied_groups(full, split) == [(["transformer.wte.weight", "lm_head.weight"], [0, 1])]
    prune(full, split, layout.stages_of(1))  # rank 1: stages 1 and 3, blocks 1 and 3, final norm, head
    kept = set(full.state_dict())
    assert kept < names
    assert {k.split(".")[2] for k in kept if k.startswith("transformer.h.")} == {"1", "3"}
    assert "lm_head.weight" in kept and "transformer.ln_f.weight" in kept and "transformer.wte.weight" not in kept


@pytest.mark.parametrize("argv,message", [
    (["--pipeline-schedule", "zigzag"], "--pipeline-schedule 'zigzag' is not valid; choose one of: gpipe, 1f1b, "
                                        "interleaved"),
    (["--nproc", "3", "--pipeline-schedule", "interleaved", "--batch-size", "12"],  # the embedded 3 + 2 block T5
     "cuts the model into 6 stages (3 processes x 2 stages per rank), but it has only 5 blocks"),
    (["--nproc", "4", "--pp", "3"], "pp 3 x dp_replicate 1 x dp_shard 1 x tp 1 multiply to 3, but the job has 4 processes"),
    (["--nproc", "4", "--pp", "2", "--dp-shard", "2"], "--dp-shard 2 shards model states, which needs ZeRO stage"),
    (["--stages-per-rank", "2"], "--stages-per-rank 2 needs --pipeline-schedule interleaved"),
    (["--chunks", "3", "--batch-size", "8"], "--chunks 3 must divide the micro-batch of 8 samples"),
    (["--nproc", "1"], "a pipeline runs one process per stage"),
])
def test_bad_pipeline_input_fails_before_any_work(tmp_path, capsys, argv, message):
    from bigfit.cli import main

    out = tmp_path / "out"
    assert main(["train", "--strategy", "pipeline", "--nproc", "2", *argv, "--output-dir", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_pipeline_flags_belong_to_the_pipeline(tmp_path, capsys):
    from bigfit.cli import main

    assert main(["train", "--strategy", "zero3", "--pipeline-schedule", "gpipe", "--output-dir", str(tmp_path)]) == 2
    assert "--pipeline-schedule belong(s) to a pipeline (--strategy pipeline or --pp 2 or more), not zero3" \
        in capsys.readouterr().err
