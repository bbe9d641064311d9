"""bigfit.tensor on 2 gloo ranks against a single-process reference: T5 (tied embeddings, unequal
depth, relative attention bias split by heads), GPT-2 (Conv1D, fused c_attn split by heads, tied
wte/lm_head), a Llama-style model (RoPE, GQA: 4 heads, 2 KV heads, one per rank; a padding row) and
Qwen 3 (its transformers plan, with per-head q/k norms replicated and their gradients all-reduced),
embeddings and LM head split by vocabulary into the vocabulary-parallel loss; and GPT-2 with a
vocabulary of 385 rows, which stay replicated. The same seeded
model on every rank, split over a TP mesh of 2, then 3 AdamW steps with clipping on one fixed batch:
losses and gradient norms each step, gathered parameters after, in fp32 and in bf16 autocast; the
full state dict in Hugging Face layout; logits split per rank, whole for generate(). FSDP2 over TP and ranks that start on the meta
device run through the training loop in tests/test_parallel_apply.py.

The causal batch has 48 tokens, more than GPT-2's 32 input features: the fused c_attn moves its
weight to the heads layout in training, and its output in generate() (a few tokens a step).
All cases run in one launch (a 2-rank launch costs ~6 s of imports on this machine).

Tolerances are about 10x the worst difference measured on torch 2.13, CPU (printed with -s). fp32:
the runs differ in the order of sums only (row-parallel partial sums, split norms); worst seen: loss
2.7e-7 relative, gradient norm 7.5e-6, first gradients 9.2e-7 of each tensor's largest. Parameters
after 3 steps: 2.5e-4, because AdamW's first steps move an element whose gradient is below its eps
(1e-8) by lr * gradient / eps, so summation noise of 1e-10 there moves it by 1e-4. bf16: partial sums
are rounded to bf16 before their all-reduce (worst seen: loss 1.4e-3, norm 2.0e-2, first gradients
7.8e-3); an element whose gradient is near zero can flip sign, and AdamW then moves it by up to 2 * lr
per step the other way: the parameters are bound by that (6e-2 over 3 steps; worst seen 4.7e-2).
On torch 2.11 + transformers 5.17 (the GPU machine's CPUs, 8 threads a rank) all within these too
(worst: fp32 gradient norm 1.1e-5, first gradients 1.2e-6, parameters 3.7e-4).
"""
from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES
from dist import run_ranks, threads_per_rank, torch_threads
from tiny import tiny_config, twin_models

from bigfit.errors import BigfitError
from bigfit.tensor import check_tensor_parallel

STEPS, LR = 3, 1e-2
# (loss relative, gradient norm relative, first gradients relative to each tensor's largest element,
# parameters absolute); see the module docstring
TOL = {"fp32": (3e-6, 1e-4, 1e-5, 3e-3), "bf16": (1.5e-2, 0.2, 8e-2, 2 * LR * STEPS)}
# qwen3: a plan from transformers with per-head q/k norms (replicated, gradients all-reduced)
# (meta-device ranks, FSDP2 over TP and Llama in bf16 run through the training loop: tests/test_parallel_apply.py)
# gpt2-385: a vocabulary that 2 does not divide, so embeddings and head stay replicated; +sp: sequence
# parallelism, llama-385+sp both
SEQUENCE = tuple(f"{f}+sp" for f in (*FAMILIES, "qwen3", "llama-385"))
CASES = [(f, "fp32") for f in (*FAMILIES, "qwen3", "gpt2-385", *SEQUENCE)] + [("gpt2", "bf16"), ("llama+sp", "bf16")]


def config(family: str):
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                           eos_token_id=1, bos_token_id=1)
    if family.endswith("-385"):
        base = tiny_config(family[:-4])
        return base.__class__(**{**base.to_dict(), "vocab_size": 385})
    return tiny_config(family)


def seeded(family: str, device: str = "cpu"):
    """The reference's weights (tests/tiny.py seeds every family alike)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if family in FAMILIES and device == "cpu":
        return twin_models(family)[0]
    torch.manual_seed(0)
    with torch.device(device):
        return (AutoModelForSeq2SeqLM if family == "t5" else AutoModelForCausalLM).from_config(config(family))


def batch(family: str) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 384, (4, 12), generator=g)
    if family == "t5":
        labels = torch.randint(2, 384, (4, 8), generator=g)
        return dict(input_ids=ids, labels=labels, decoder_input_ids=torch.cat([torch.zeros(4, 1, dtype=torch.long),
                                                                               labels[:, :-1]], 1))
    return dict(input_ids=ids, labels=ids)


def train(model, family: str, precision: str, clip, groups=list) -> dict:
    """STEPS steps of fused AdamW (the project's optimizer) with clipping at 1.0 on one batch, on the
    project's loss (token mean): a split model's logits are split by vocabulary."""
    from bigfit.engine.losses import target_tokens, token_loss

    opt = torch.optim.AdamW(groups(model.parameters()), lr=LR, fused=True)
    losses, norms, data = [], [], batch(family)
    inputs = {k: v for k, v in data.items() if k != "labels"}
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(**inputs).logits
        loss = token_loss(logits, data["labels"], family == "t5") / target_tokens(data["labels"], family == "t5")
        loss.backward()
        if step == 0:  # gathered: full_tensor() is a collective, on every rank
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for n, p in model.named_parameters()}
        norms.append(float(clip([p for p in model.parameters() if p.grad is not None], 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return dict(losses=losses, norms=norms, grads=grads, params=full_state(model))


def full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return {k: v.detach().clone() for k, v in
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}


def prompt(family: str) -> dict:
    """Greedy for the decoders, beams for T5 (its cache of local heads reordered per beam), in a cache
    that grows by layer (transformers sizes its default by the encoder's depth: unequal T5 stacks fail)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    kw = dict(num_beams=2, past_key_values=EncoderDecoderCache(DynamicCache(), DynamicCache())) if family == "t5" \
        else dict(num_beams=1)
    return dict(input_ids=batch(family)["input_ids"][:2, :5], max_new_tokens=4, do_sample=False, **kw)


def ties(model) -> list[list[str]]:
    """Names of the parameters that share one tensor (tied embeddings), per shared tensor."""
    seen = {}
    for mod_name, mod in model.named_modules():
        for name, p in mod.named_parameters(recurse=False):
            seen.setdefault(id(p), []).append(f"{mod_name}.{name}".lstrip("."))
    return sorted(names for names in seen.values() if len(names) > 1)


def split(family: str):
    """The seeded model split over a TP mesh of 2 (`family` ending in +sp: with sequence parallelism)."""
    from torch.distributed.device_mesh import init_device_mesh

    from bigfit.tensor import apply_tensor_parallel

    model = seeded(family.removesuffix("+sp"))
    tied = ties(model)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    notes = apply_tensor_parallel(model, mesh["tp"], sequence=family.endswith("+sp"))
    assert ties(model) == tied
    return model, notes


def run_split(family: str, precision: str) -> dict:
    import torch.distributed as dist

    from bigfit.engine.norms import clip_by, global_norm
    from bigfit.tensor import param_groups

    model, notes = split(family)
    clip = lambda ps, n: clip_by(ps, n, global_norm(ps, dist.get_world_size()))  # noqa: E731  as the loop's engines
    out = train(model, family.removesuffix("+sp"), precision, clip, param_groups)
    return dict(out, notes=notes, ties=ties(model))


def tp_job() -> dict:
    """Every case on this rank; rank 0's results are compared."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from bigfit.tensor import apply_tensor_parallel, whole_logits

    model = seeded("gpt2")  # a TP mesh of one rank changes nothing
    got = {"tp1": (apply_tensor_parallel(model, init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))["tp"]),
                   any(isinstance(p, DTensor) for p in model.parameters()))}
    got.update({f"{f}-{p}": run_split(f, p) for f, p in CASES})
    for f in FAMILIES:
        model, _ = split(f)
        got[f"{f}-initial"] = full_state(model)
        got[f"{f}-dtensors"] = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
        inputs = {k: v for k, v in batch(f).items() if k != "labels"}
        with torch.no_grad():
            split_logits = model(**inputs).logits
            with whole_logits(model):
                got[f"{f}-logits"] = (tuple(split_logits.to_local().shape), tuple(model(**inputs).logits.shape))
                got[f"{f}-generate"] = model.generate(**prompt(f))
    for f in FAMILIES:  # after the prompt, a sequence of one token a step, on two ranks
        model, _ = split(f"{f}+sp")
        with torch.no_grad(), whole_logits(model):
            got[f"{f}+sp-generate"] = model.generate(**prompt(f))
    return got


def reference_job() -> dict:
    got = {}
    with torch_threads(threads_per_rank(2)):  # compute as each rank does
        for family, precision in CASES:
            base = family.removesuffix("+sp")
            if f"{base}-{precision}" in got:  # sequence parallelism has the same reference
                got[f"{family}-{precision}"] = got[f"{base}-{precision}"]
                continue
            ref = seeded(base)
            clip = lambda ps, n: torch.nn.utils.clip_grad_norm_(ps, n)  # noqa: E731
            got[f"{family}-{precision}"] = dict(train(ref, base, precision, clip), ties=ties(ref))
        for family in FAMILIES:
            ref = seeded(family)
            got[f"{family}-initial"] = full_state(ref)
            with torch.no_grad():
                got[f"{family}-generate"] = ref.generate(**prompt(family))
    return got


@pytest.fixture(scope="module")
def runs():
    refs, failed = {}, []

    def references():  # an error here must not leave the ranks running: raise it after they report
        try:
            refs.update(reference_job())
        except Exception as e:
            failed.append(e)

    ranks = run_ranks(tp_job, 2, meanwhile=references)
    if failed:
        raise failed[0]
    return ranks[0], refs


def compare(ref: dict, got: dict, precision: str, label: str) -> None:
    loss_tol, norm_tol, grad_tol, param_tol = TOL[precision]
    assert ref["losses"][-1] < ref["losses"][0]  # it trained
    loss = max(abs(a - b) / a for a, b in zip(ref["losses"], got["losses"]))
    norm = max(abs(a - b) / a for a, b in zip(ref["norms"], got["norms"]))
    assert ref["params"].keys() == got["params"].keys() and ref["grads"].keys() == got["grads"].keys()
    grad, name = max(((r - got["grads"][k]).abs().max().item() / r.abs().max().item(), k)
                     for k, r in ref["grads"].items())
    param = max((ref["params"][k] - got["params"][k]).abs().max().item() for k in ref["params"])
    print(f"{label}: loss rel {loss:.1e}, grad norm rel {norm:.1e}, first grads rel {grad:.1e} ({name}), "
          f"params abs {param:.1e}")
    assert loss <= loss_tol, (got["losses"], ref["losses"])
    assert norm <= norm_tol, (got["norms"], ref["norms"])
    assert grad <= grad_tol, name
    assert param <= param_tol


@pytest.mark.parametrize("family,precision", CASES)
def test_matches_single_process(runs, family, precision):
    got, refs = runs
    compare(refs[f"{family}-{precision}"], got[f"{family}-{precision}"], precision, f"{family} {precision} tp 2")


@pytest.mark.parametrize("family", FAMILIES)
def test_full_state_dict_is_hugging_face_layout(runs, family):
    got, refs = runs
    ref, mine = refs[f"{family}-initial"], got[f"{family}-initial"]
    assert {k: v.shape for k, v in ref.items()} == {k: v.shape for k, v in mine.items()}
    assert all(torch.equal(ref[k], mine[k]) for k in ref)  # no permutation: the same tensors
    # the block projections: llama 7 a block; gpt2 4 Conv1Ds with biases; t5 q, k, v, o, wi, wo (+ q, k,
    # v, o of cross-attention in the decoder) and the first block's relative bias in each stack; and the
    # embedding and head, split by vocabulary (one parameter where tied). Norms and GPT-2's positions stay plain.
    dtensors = got[f"{family}-dtensors"]
    assert len(dtensors) == {"llama": 2 * 7 + 2, "gpt2": 2 * 8 + 1, "t5": 2 * 6 + 3 * 10 + 2 + 1}[family], dtensors
    assert {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight", "t5": "shared.weight"}[family] \
        in dtensors
    assert not any(part in n for n in dtensors for part in ("wpe", "norm", "ln_"))


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_embeddings_stay_one_parameter_and_generate_matches(runs, family):
    got, refs = runs
    assert got[f"{family}-fp32"]["ties"] == refs[f"{family}-fp32"]["ties"]
    assert (got[f"{family}-fp32"]["ties"] != []) == (family != "llama")
    assert torch.equal(got[f"{family}-generate"], refs[f"{family}-generate"])
    assert "tensor parallel 2: " in got[f"{family}-fp32"]["notes"][0]
    assert got[f"{family}-fp32"]["notes"][0].endswith("embeddings and LM head split by vocabulary")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_holds_half_the_logits_and_generate_sees_them_whole(runs, family):
    split_shape, whole_shape = runs[0][f"{family}-logits"]
    assert split_shape == (4, 8 if family == "t5" else 12, 192) and whole_shape == (*split_shape[:2], 384)


@pytest.mark.parametrize("family", FAMILIES)
def test_sequence_parallel_generates_as_the_single_process_model(runs, family):
    got, refs = runs
    assert torch.equal(got[f"{family}+sp-generate"], refs[f"{family}-generate"])
    assert got[f"{family}+sp-fp32"]["notes"][0].endswith("; residual stream and norms split by sequence")
    assert "385 rows do not split 2 ways" in got["llama-385+sp-fp32"]["notes"][0]


def test_sequence_parallel_names_the_models_it_supports():
    from transformers import Phi3Config

    with pytest.raises(BigfitError, match="--sequence-parallel does not support model type 'phi3' \\(its plan uses "
                                          "'colwise_gather_output'\\); it supports gpt2, t5 and models whose"):
        check_tensor_parallel(Phi3Config(), 2, sequence=True)


def test_a_vocabulary_the_degree_does_not_divide_stays_replicated(runs):
    got, _ = runs
    assert got["gpt2-385-fp32"]["notes"][0].endswith("embeddings and LM head replicated (385 rows do not split 2 ways)")


def test_a_mesh_of_one_rank_changes_nothing(runs):
    assert runs[0]["tp1"] == ([], False)


@pytest.mark.parametrize("family,tp,message", [
    ("llama", 3, "tensor parallel degree 3 does not divide the 4 attention heads of this llama model; "
                 "valid degrees: 1, 2"),
    ("llama", 4, "tensor parallel degree 4 does not divide the 2 KV heads of this llama model; valid degrees: 1, 2"),
    ("t5", 3, "tensor parallel degree 3 does not divide the 4 attention heads of this t5 model; "
              "valid degrees: 1, 2, 4"),
    ("gpt2", 0, "tensor parallel degree 0 is not valid; it must be a whole number of at least 1"),
])
def test_degrees_that_cannot_split_the_model_say_which_can(family, tp, message):
    with pytest.raises(BigfitError) as e:
        check_tensor_parallel(config(family), tp)
    assert str(e.value) == message
    check_tensor_parallel(config(family), 2)  # no error


def test_models_without_a_plan_are_named():
    from transformers import BertConfig, MixtralConfig

    with pytest.raises(BigfitError, match="model type 'bert' has no tensor-parallel plan; supported: gpt2, t5"):
        check_tensor_parallel(BertConfig(), 2)
    # Mixtral's plan as transformers 5.24 ships it (5.25 dropped the experts from the base plan)
    mixtral = MixtralConfig()
    mixtral.base_model_tp_plan = {**mixtral.base_model_tp_plan, "layers.*.mlp.experts": "moe_tp_experts"}
    with pytest.raises(BigfitError, match="plan of model type 'mixtral' uses style 'moe_tp_experts', which bigfit "
                                          "cannot apply; supported styles: colwise, rowwise"):
        check_tensor_parallel(mixtral, 2)
    check_tensor_parallel(BertConfig(), 1)  # nothing to split
