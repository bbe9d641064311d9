"""Which module of each family gets which ParallelStyle, which per-rank attributes the attention
code then needs, and whether a TP degree can split a model: from its config alone.

Three sources of plans:
- the model's own `config.base_model_tp_plan`, where transformers ships one (Llama, Mistral, Qwen,
  Gemma, ...), its style names translated into torch's styles;
- GPT-2 (no plan in transformers: Conv1D layers, fused c_attn): styles.py;
- T5 / mT5 (no plan in transformers): q, k, v and FFN wi column-parallel, o and wo row-parallel,
  the relative attention bias Embedding(buckets, heads) split by heads.
In all three, where the TP degree divides the vocabulary, the token embeddings are split by
vocabulary rows (styles.VocabRowwise: each rank looks up its rows, the partial sums all-reduced)
and so is the LM head (styles.VocabColwise: logits split by vocabulary into the vocabulary-parallel
loss), which saves (tp - 1) / tp of the largest activation of a small model, its logits, and of the
embedding's states. Otherwise both stay replicated. Sequence parallelism (`_split_sequence`) is the
same plan with the residual stream split by sequence between the parallel regions."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ..adapters.lora import is_lora_layer
from ..errors import BigfitError
from .styles import (Conv1DColwise, Conv1DRowwise, FusedConv1DColwise, GatherSequence, SplitSequence, VocabColwise,
                     VocabRowwise)

T5_TYPES = ("t5", "mt5")

# transformers' style names -> torch's styles. None: left to `vocab_styles`, which splits the
# embeddings and LM head of every family alike (and keeps tied ones one parameter).
HF_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    # fused projections (Phi-3's qkv_proj) or norms over all heads (OLMo 2): whole outputs on every rank
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    # per-head q/k norms (Qwen 3, Gemma 3) on (batch, seq, heads, head_dim) inputs of local heads:
    # replicated weights, the input marked as split on its heads dim, so DTensor all-reduces the
    # weight's gradient, to which every rank's heads contribute
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
    "embedding_rowwise": None,
    "embedding_colwise": None,
}
# per-rank head counts that attention code may read (transformers 5.x mostly reshapes with -1)
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")


@dataclass
class TensorPlan:
    styles: dict[str, ParallelStyle] = field(default_factory=dict)  # module name -> its style
    local: list[tuple[nn.Module, tuple[str, ...]]] = field(default_factory=list)  # attributes to divide by tp
    blocks: str = ""  # for the start-of-run note


def split_counts(config) -> dict[str, int]:
    """What the TP degree must divide, named as the error line names it."""
    kind = config.model_type
    if kind == "gpt2":
        return {"attention heads": config.n_head, "FFN width": config.n_inner or 4 * config.n_embd}
    if kind in T5_TYPES:
        return {"attention heads": config.num_heads, "FFN width": config.d_ff}
    _hf_styles(config)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return {"attention heads": heads, "KV heads": kv, "FFN width": config.intermediate_size}


# the styles of a transformers plan that sequence parallelism knows how to enter and leave around
SEQUENCE_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise")


def check(config, tp, sequence: bool = False) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise BigfitError(f"tensor parallel degree {tp!r} is not valid; it must be a whole number of at least 1")
    if sequence:
        _check_sequence(config)
    if tp == 1:  # nothing is split: any model will do
        return
    counts = split_counts(config)
    valid = ", ".join(str(d) for d in _divisors(math.gcd(*counts.values())))
    for what, n in counts.items():
        if n % tp:
            raise BigfitError(f"tensor parallel degree {tp} does not divide the {n} {what} of this "
                              f"{config.model_type} model; valid degrees: {valid}")


def _check_sequence(config) -> None:
    """Sequence parallelism needs blocks of norm -> attention or MLP -> residual add, whose row-parallel
    layers it can make reduce-scatter: GPT-2, T5 and the transformers plans of colwise / rowwise styles
    (Llama, Mistral, Qwen, ...)."""
    kind = config.model_type
    if kind == "gpt2" or kind in T5_TYPES:
        return
    plan = getattr(config, "base_model_tp_plan", None) or {}
    other = sorted({s for s in plan.values() if s not in SEQUENCE_STYLES})
    if not plan or other:
        why = f"its plan uses {other[0]!r}" if other else "it has no transformers tensor-parallel plan"
        raise BigfitError(f"--sequence-parallel does not support model type {kind!r} ({why}); it supports gpt2, t5 "
                          "and models whose transformers plan uses only colwise/rowwise styles (llama, mistral, "
                          "qwen2, qwen3, ...); drop --sequence-parallel")


def build(model: nn.Module, sequence: bool = False) -> TensorPlan:
    kind = model.config.model_type
    plan = _gpt2(model) if kind == "gpt2" else _t5(model) if kind in T5_TYPES else _from_config(model)
    if sequence:
        _check_sequence(model.config)
        _split_sequence(model, plan)
    return plan


def _split_sequence(model: nn.Module, plan: TensorPlan) -> None:
    """Megatron's sequence parallelism on a plan: the residual stream a DTensor split by sequence
    (Shard(1)) between the blocks' parts; every norm on it runs on this rank's tokens (torch's
    SequenceParallel: weights replicated, their gradients all-reduced); each module holding
    row-parallel layers (attention, MLP, T5's cross-attention with its encoder states) all-gathers its
    inputs (GatherSequence; as plain tensors for GPT-2's fused c_attn, which reduces its own input
    gradient), and those layers reduce-scatter their output by sequence instead of all-reducing it.
    Embeddings that no other style splits (GPT-2's positions) enter the split (SplitSequence)."""
    rowwise = [n for n, s in plan.styles.items() if isinstance(s, (RowwiseParallel, Conv1DRowwise))]
    fused = {n.rpartition(".")[0] for n, s in plan.styles.items() if isinstance(s, FusedConv1DColwise)}
    for name in rowwise:
        plan.styles[name] = Conv1DRowwise(sequence=True) if isinstance(plan.styles[name], Conv1DRowwise) else \
            RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        parent = name.rpartition(".")[0]
        plan.styles[parent] = GatherSequence(local=parent in fused)
    tokens = {name for name, _ in token_embeddings(model)}  # vocab_styles' to split
    for name, mod in model.named_modules():
        if name in plan.styles or name in tokens:
            continue
        if "norm" in type(mod).__name__.lower():
            plan.styles[name] = SequenceParallel(use_local_output=False)
        elif isinstance(mod, nn.Embedding):
            plan.styles[name] = SplitSequence()


def vocab_rows(model: nn.Module) -> int:
    """The vocabulary tensor parallelism can split: the config's vocab_size, or 0 where a token
    embedding of that many rows is not a plain nn.Embedding (Gemma's scaled one: its own forward) or
    the head is not an nn.Linear. Read off the modules, not the model's accessors: a pipeline stage
    holds only some of them (the rest are stand-ins), and every stage must decide alike, for tied
    copies to be summed shard by shard."""
    head = model.get_output_embeddings()
    held = head is not None and any(True for _ in head.parameters())  # not another stage's stand-in
    plain = all(type(m) is nn.Embedding for _, m in token_embeddings(model))
    if not plain or (held and not isinstance(head, nn.Linear)):
        return 0
    return model.config.vocab_size


def token_embeddings(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """(name, module) of every embedding with a row per token of the vocabulary (T5: shared, encoder
    and decoder), which the vocabulary split divides and sequence parallelism leaves to it."""
    rows = model.config.vocab_size
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and m.num_embeddings == rows]


def splits_vocab(rows: int, tp: int) -> bool:
    """Whether embeddings and LM head are split by vocabulary at this degree (`rows`: vocab_rows)."""
    return tp > 1 and rows > 0 and rows % tp == 0


def vocab_styles(model: nn.Module, tp: int, sequence: bool = False) -> dict[str, ParallelStyle]:
    """Every token embedding (T5's shared one and its encoder's and decoder's, which hold the same
    weight) VocabRowwise and the LM head VocabColwise; where the vocabulary does not split, none, or
    under sequence parallelism the replicated embeddings' outputs split by sequence and the head's
    input gathered."""
    rows = vocab_rows(model)
    split = splits_vocab(rows, tp)
    if not split and not sequence:
        return {}
    head = model.get_output_embeddings()
    styles: dict[str, ParallelStyle] = {name: VocabRowwise(sequence) if split else SplitSequence()
                                        for name, _ in token_embeddings(model)}
    if isinstance(head, nn.Linear):
        styles[_prefix_of(model, head).rstrip(".")] = VocabColwise() if split else GatherSequence(local=True)
    return styles


def _gpt2(model: nn.Module) -> TensorPlan:
    plan, width = TensorPlan(), model.config.n_embd
    for name, mod in model.named_modules():
        if hasattr(mod, "c_attn") and hasattr(mod, "split_size"):  # GPT2Attention
            plan.styles[f"{name}.c_attn"] = FusedConv1DColwise(base_of(mod.c_attn).nf // width, width)
            plan.styles[f"{name}.c_proj"] = Conv1DRowwise()
            if hasattr(mod, "q_attn"):  # cross-attention: c_attn is [k | v], q_attn a plain Conv1D
                plan.styles[f"{name}.q_attn"] = Conv1DColwise()
            plan.local.append((mod, ("num_heads", "split_size", "embed_dim")))
        elif hasattr(mod, "c_fc") and hasattr(mod, "c_proj"):  # GPT2MLP
            plan.styles[f"{name}.c_fc"], plan.styles[f"{name}.c_proj"] = Conv1DColwise(), Conv1DRowwise()
    plan.blocks = f"{model.config.n_layer} blocks"
    return plan


def _t5(model: nn.Module) -> TensorPlan:
    plan, cfg = TensorPlan(), model.config
    for name, mod in model.named_modules():
        if all(hasattr(mod, a) for a in ("q", "k", "v", "o", "n_heads")):  # T5Attention
            for proj in "qkv":
                plan.styles[f"{name}.{proj}"] = ColwiseParallel()
            plan.styles[f"{name}.o"] = RowwiseParallel()
            if getattr(mod, "has_relative_attention_bias", False):
                # Embedding(buckets, heads): torch's ColwiseParallel splits an Embedding's dim 1, the heads.
                # Blocks without one take the first block's bias, of this rank's heads as well.
                plan.styles[f"{name}.relative_attention_bias"] = ColwiseParallel()
            # n_heads also sizes the zero bias of the decoder's cross-attention, which has no table
            plan.local.append((mod, ("n_heads", "inner_dim")))
        elif hasattr(mod, "wo") and (hasattr(mod, "wi") or hasattr(mod, "wi_0")):  # T5Dense(Gated)ActDense
            for proj in ("wi", "wi_0", "wi_1"):
                if hasattr(mod, proj):
                    plan.styles[f"{name}.{proj}"] = ColwiseParallel()
            plan.styles[f"{name}.wo"] = RowwiseParallel()
    plan.blocks = f"{cfg.num_layers + cfg.num_decoder_layers} blocks ({cfg.num_layers} encoder, " \
                  f"{cfg.num_decoder_layers} decoder)"
    return plan


def _from_config(model: nn.Module) -> TensorPlan:
    """transformers' plan, whose keys are relative to the base model ("layers.*.self_attn.q_proj")."""
    plan, styles = TensorPlan(), _hf_styles(model.config)
    prefix = _prefix_of(model, model.base_model)
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"[^.]+") + "$"), k) for k in styles]
    for name, mod in model.base_model.named_modules():
        for pattern, key in patterns:
            if pattern.match(name) and styles[key] is not None:
                plan.styles[prefix + name] = styles[key]()
                parent = model.base_model.get_submodule(name.rpartition(".")[0])
                counts = tuple(a for a in HEAD_COUNTS if isinstance(getattr(parent, a, None), int))
                if model.config.base_model_tp_plan[key] == "colwise" and counts and (parent, counts) not in plan.local:
                    plan.local.append((parent, counts))
    plan.blocks = f"{model.config.num_hidden_layers} blocks"
    return plan


def _hf_styles(config) -> dict:
    """The config's plan as style factories; BigfitError where it has none or uses one we lack."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise BigfitError(f"model type {config.model_type!r} has no tensor-parallel plan; supported: gpt2, t5, "
                          "mt5 and models whose config carries base_model_tp_plan (llama, mistral, qwen2, ...)")
    unknown = sorted({s for s in plan.values() if s not in HF_STYLES})
    if unknown:
        raise BigfitError(f"the tensor-parallel plan of model type {config.model_type!r} uses style "
                          f"{unknown[0]!r}, which bigfit cannot apply; supported styles: {', '.join(HF_STYLES)}")
    return {k: HF_STYLES[s] for k, s in plan.items()}


def _prefix_of(model: nn.Module, sub: nn.Module) -> str:
    if sub is model:
        return ""
    return next(name for name, mod in model.named_modules() if mod is sub) + "."


def base_of(module: nn.Module) -> nn.Module:
    """The layer a plan splits: peft's base_layer inside a LoRA layer (tensor/adapters.py), else itself."""
    return module.base_layer if is_lora_layer(module) else module


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
