"""What planning needs to know about a model, found without memory: the model is built under
FakeTensorMode (shapes, no storage; transformers also takes its tracing-friendly code paths there)
and one training forward is run at the job's batch and sequence lengths, recording every tensor
autograd saves for backward. Those saved tensors ARE the activation memory, for any model family and
the attention implementation that will run.
"""
from __future__ import annotations

import contextlib
import copy
import re
from collections import OrderedDict
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ..common.precision import DTYPES
from ..errors import BigfitError
from ..models.source import block_lists, is_seq2seq
from .adapters import flop_weight, frozen_counts, module_flop_weight, with_adapters
from .cudatrace import CudaAutocast, cuda_kernels
from .opcount import OpCounter
from .quantized import base_counts
from .shorten import kept, shortened, widen
from .tp_trace import TensorSplit, sequence_error, split_counts


@dataclass
class ModelProfile:
    params: int  # parameters, tied ones once
    embedding_params: int  # input embedding rows (no matmul): excluded from FLOPs
    largest_unit_params: int  # the largest block (an FSDP unit / what ZeRO-3 gathers at once)
    root_params: int  # parameters outside the blocks (embeddings, final norms, head)
    n_blocks: int
    block_saved: list[int]  # bytes autograd saves inside each block, per micro-batch
    block_inputs: list[int]  # bytes of each block's tensor inputs: what activation checkpointing keeps
    other_saved: int  # saved outside blocks: embeddings, final norm, head, loss
    logits_bytes: int  # the head's output in the compute dtype
    tokens: int  # tokens per micro-batch (encoder + decoder for encoder-decoders)
    flops_per_token: float = 0.0  # model FLOPs per token (of source and target): _block_flops, and the head
    loss_saved: int = 0  # the part of other_saved the loss itself saves (its fp32 log-softmax)
    logits_numel: int = 0  # elements of the head's output
    head_params: int = 0  # the output head's weight (tied or not): its gradient comes first in backward
    matmul_params: int = 0  # parameters of linear layers: what autocast copies to the compute dtype
    block_params: list[int] = field(default_factory=list)  # each block's parameters, in execution order
    stacks: list[tuple[str, int]] = field(default_factory=list)  # (path, blocks) of each stack (models.block_lists)
    # parameters outside the blocks as (elements, the blocks a pipeline cut puts them with, rows): split.anchors
    outside: list[tuple[int, tuple[int, ...], int]] = field(default_factory=list)
    pipeline_error: str | None = None  # why --strategy pipeline cannot cut this model
    notes: list[str] = field(default_factory=list)
    # tensor parallelism (tp_trace.py): each block's parameters it splits, the part of each block's saved
    # bytes it divides, the elements per token it all-reduces (forward, backward); what a degree must divide
    block_tp_params: list[int] = field(default_factory=list)
    block_tp_saved: list[int] = field(default_factory=list)
    block_sp_saved: list[int] = field(default_factory=list)  # what sequence parallelism divides besides
    sp_error: str | None = None  # why this model has no sequence parallelism
    tp_reduce: list[tuple[int, int]] = field(default_factory=list)
    hidden: int = 0
    tp_counts: dict[str, int] = field(default_factory=dict)
    tp_error: str | None = None  # why this model has no tensor-parallel plan
    vocab_rows: int = 0  # the vocabulary tensor parallelism splits embeddings and head by (0: never)
    vocab_params: int = 0  # the parameters that split divides: token embeddings and head, tied ones once
    # operators each block's forward dispatches (views aside), and those outside the blocks (embeddings,
    # head, loss): what the host issues per micro-batch whatever its size (hostcost.py)
    block_ops: list[int] = field(default_factory=list)
    other_ops: int = 0
    # bytes each block's forward reads and writes outside its matmuls and attention (_OpCounter), per
    # micro-batch, and outside the blocks: memory-bound time on the device (devicecost.py)
    block_traffic: list[int] = field(default_factory=list)
    other_traffic: int = 0
    # each block's forward FLOPs per micro-batch in fp32 matmuls where the compute dtype is lower: slower
    # than the block's other FLOPs by the tensor cores' factor (devicecost.py)
    block_fp32_flops: list[int] = field(default_factory=list)
    # each block's model FLOPs per sample (forward and backward): its matmuls, and its attention's
    # query-key products, which tensor parallelism divides by heads (_block_flops)
    block_matmul_flops: list[float] = field(default_factory=list)
    block_attention_flops: list[float] = field(default_factory=list)
    attention_per_token: float = 0.0  # the attention's part of flops_per_token
    # LoRA (adapters.py): the parameters that do not train (the frozen base), each block's, and whether
    # the head's weight is one; none without LoRA. Gradients, optimizer states and their traffic skip them.
    frozen_params: float = 0
    block_frozen: list[float] = field(default_factory=list)
    head_frozen: bool = False
    # QLoRA (quantized.py): the LoRA base layers' weights, which --load-in-4bit stores in 4 bits
    quantized_params: int = 0
    quantized_layers: int = 0
    largest_quantized: int = 0  # the largest of those layers: its bf16 copy is the dequantisation's temporary
    unit_quantized: int = 0  # those in the largest block: FSDP2 gathers them in 4 bits with that unit
    block_quantized: list[float] = field(default_factory=list)  # those in each block (device maps, stages)
    nf4_ranks: int = 0  # torchao's NF4 splits every base layer into whole blocks over its divisors (0: none)
    vocab: int = 0  # the logits' last dimension: the chunked loss's rule (layout/activations.py) reads it
    kv_width: int = 0  # key/value heads x head dim: what context parallelism gathers per token (planning/keeping.py)
    # the chunked loss (keeping.chunk_loss): the head's matmul again in backward, FLOPs per output token
    head_flops_again: float = 0.0

    @property
    def trainable_params(self) -> float:
        """What the optimizer steps: LoRA's adapters, or every parameter."""
        return self.params - self.frozen_params

    @property
    def root_frozen(self) -> float:
        return self.frozen_params - sum(self.block_frozen)

    @property
    def root_trainable(self) -> float:
        return self.root_params - self.root_frozen

    @property
    def largest_trainable_unit(self) -> float:
        """The largest block's trainable parameters: its gradients in one reduce-scatter or bucket."""
        if not self.frozen_params:
            return self.largest_unit_params
        return max((n - f for n, f in zip(self.block_params, self.block_frozen)), default=0)

    @property
    def trainable_head(self) -> float:
        return 0 if self.head_frozen else self.head_params

    def blocks_frozen(self) -> list[float]:
        return self.block_frozen or [0] * len(self.block_params)

    def outside_flops_per_token(self) -> float:
        """Model FLOPs a token of the non-embedding parameters outside the blocks (an untied head,
        norms); frozen ones (LoRA's) skip their weight gradient."""
        outside = max(0, self.root_params - self.embedding_params)
        return flop_weight(outside, min(outside, self.root_frozen)) + self.head_flops_again

    def activations(self, checkpointing: bool, checkpointed: list[bool] | None = None, offload: bool = False) -> int:
        """Saved bytes of a micro-batch at the end of forward. Checkpointed blocks (`checkpointed`, each
        block's flag; None: all) keep their inputs, and one block's activations exist again while it is
        recomputed; the others keep theirs, and backward reaches them first (the checkpointed blocks are
        the first of each stack), so the recompute comes after they are freed: the larger of the two
        counts. `offload`: the checkpointed inputs wait in host RAM but for OFFLOAD_IN_FLIGHT of them
        (`offloaded` is what the host holds)."""
        if not checkpointing:
            return sum(self.block_saved) + self.other_saved
        flags = checkpointed or [True] * max(len(self.block_inputs), len(self.block_saved))
        inputs = [x for x, on in zip(self.block_inputs, flags) if on]
        kept = sum(b for b, on in zip(self.block_saved, flags) if not on)
        recompute = max((b for b, on in zip(self.block_saved, flags) if on), default=0)
        held = OFFLOAD_IN_FLIGHT * max(inputs, default=0) if offload else sum(inputs)
        return held + self.other_saved + max(kept, recompute)

    def offloaded(self, checkpointed: list[bool] | None = None) -> int:
        """Bytes of a micro-batch's checkpointed block inputs: what --activations offload copies to host
        RAM in forward and back before each block's backward."""
        flags = checkpointed or [True] * len(self.block_inputs)
        return sum(x for x, on in zip(self.block_inputs, flags) if on)


# --activations offload: block inputs on the device at once, one being copied to the host (forward) or
# back (backward) while its neighbour is used (engine side stream, one block ahead)
OFFLOAD_IN_FLIGHT = 2


# What inductor's partitioner keeps of a compiled block's saved bytes: it recomputes the cheap
# elementwise operators in backward rather than saving their outputs. T5-large's compiled blocks on the
# H200 machine: 0.42 GB a sample against eager's 0.63 at batch 64 and 128 (tests/data/h200_measured.json,
# dm6c4); not measured on other families.
COMPILED_SAVED = 0.66


def as_compiled(prof: ModelProfile, compiled: bool) -> ModelProfile:
    """The profile of the job's blocks as they run: compiled ones save less (COMPILED_SAVED)."""
    if not compiled:
        return prof
    return replace(prof, block_saved=[int(b * COMPILED_SAVED) for b in prof.block_saved])


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


_traced: OrderedDict = OrderedDict()  # (the config as JSON, the arguments, the LoRA settings) -> ModelProfile
# the least recently used trace goes first: a profile is some kilobytes and one trace costs seconds. The H200
# table's 236 records ask for 38 traces; a cache of 32 that emptied itself when full made them 115.
_TRACED_KEPT = 256


def profile_model(config, micro_batch: int, seq_len: int, target_len: int, precision: str,
                  device: str = "cuda", autocast: bool = False, lora=None) -> ModelProfile:
    """The trace of one micro-batch's forward and backward (`_profile`), once per process for each
    config and shape: the planner, `--strategy auto` and `--batch-size auto` ask for the same ones.
    `lora`: a lora.LoraSettings whose adapters are injected before the trace (the base frozen)."""
    key = (config.to_json_string(), micro_batch, seq_len, target_len, precision, device, autocast, lora)
    if key in _traced:
        _traced.move_to_end(key)
        return _traced[key]
    rest = (seq_len, target_len, precision, device, autocast, lora)
    prof = None
    if micro_batch > 3:  # affine in the micro-batch from 2 on: two traces serve every larger size
        prof = _affine(*[profile_model(config, m, *rest) for m in (2, 3)], micro_batch - 2)
    _traced[key] = prof if prof is not None else _profile(config, micro_batch, *rest)
    while len(_traced) > _TRACED_KEPT:
        _traced.popitem(last=False)
    return _traced[key]


def _affine(two: ModelProfile, three: ModelProfile, k: int) -> ModelProfile | None:
    """The profile at micro-batch 2 + k from those at 2 and 3: each count two's plus k times the step
    (a saved tensor, a byte of traffic, a token grows by a sample's share; operator counts and
    parameters do not). Batch 1 is not on that line (size-1 dimensions take other views and kernels).
    None where a field other than a count differs between the two: then the size is traced."""
    def at(a, b):
        if isinstance(a, (list, tuple)) and len(a) == len(b):
            return type(a)(at(x, y) for x, y in zip(a, b))
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return a + (b - a) * k
        if a != b:
            raise ValueError(a)
        return a
    try:
        return replace(two, **{f.name: at(getattr(two, f.name), getattr(three, f.name)) for f in fields(two)})
    except ValueError:
        return None


def _profile(config, micro_batch: int, seq_len: int, target_len: int, precision: str, device: str,
             autocast: bool, lora=None) -> ModelProfile:
    """`device`: the device type the job runs on. Its attention saves different tensors: CUDA's fused
    SDPA kernels save their output and log-sum-exp; on the CPU, SDPA takes its math path whenever
    attention dropout is on (GPT-2) and saves every head's probabilities and dropout mask. The trace
    runs on CPU fake tensors, so for CUDA it swaps SDPA for a stand-in that saves what the kernels do
    (and runs the math path where CUDA does), and dropout's fused kernel: `cuda_kernels` (cudatrace.py).
    `autocast` (single, ddp, zero1 under bf16/fp16 on CUDA): fp32 weights (with `lora`, a base in the
    compute dtype and fp32 adapters), and CUDA autocast's casts applied by `CudaAutocast`; what it
    keeps in fp32 (GPT-2's residual stream, norms) is saved at 4 bytes. Weight casts are left out: the
    estimate counts them once (`matmul_params`)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.initialization import no_init_weights

    seq2seq = is_seq2seq(config)
    dtype = DTYPES[precision]
    config = copy.deepcopy(config)  # from_config(dtype=...) writes the dtype into the config it is given
    fused = cuda_kernels() if device == "cuda" else contextlib.nullcontext()
    mixed = autocast and device == "cuda" and dtype != torch.float32
    with FakeTensorMode(allow_non_fake_inputs=True), fused:
        auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
        # under autocast a frozen LoRA base is stored in the compute dtype, its adapters in fp32
        # (parallel/apply.py store_frozen): the residual stream then runs in the compute dtype too
        # no init: the trace reads shapes, not values, and initialising every fake weight took a quarter
        # of the planner's time; transformers' init_weights also ties the weights, which counts: tied here
        with no_init_weights():
            model = auto.from_config(config, dtype=torch.float32 if mixed and lora is None else dtype)
        model.tie_weights()
        if lora is not None:
            with_adapters(model, lora, torch.float32 if mixed else dtype)
        model.train()
        casts = CudaAutocast(dtype, model) if mixed else None
        with casts or contextlib.nullcontext():
            return _trace(model, seq2seq, micro_batch, seq_len, target_len, skip=casts.weight_casts if casts else None,
                          mixed=dtype != torch.float32)


def _trace(model, seq2seq: bool, b: int, t: int, tt: int, skip=None, mixed: bool = False) -> ModelProfile:
    params = {_storage_key(p): p.numel() for p in model.parameters()}
    skip = skip if skip is not None else set()  # storages that are not activations (autocast's weight casts)
    stacks = block_lists(model)
    blocks = [blk for _, s in stacks for blk in s]
    block_params = [sum(p.numel() for p in blk.parameters()) for blk in blocks]
    saved: dict = {}  # storage -> (bytes, block index or -1, what divides it: "tp", "sp" or "")
    inputs = [0] * len(blocks)
    current = [-1]
    split = TensorSplit(model, blocks, _hidden(model.config))
    keep = kept(stacks)  # the blocks that run (shorten.py): the later ones get the last one's figures

    def pack(x):  # current[0]: the block running, -1 outside blocks, -2 the loss
        key = _storage_key(x)
        if key not in params and key not in saved and key not in skip:
            saved[key] = (x.untyped_storage().nbytes(), current[0], split.divides(x) if current[0] >= 0 else "")
        return x

    def pre(i):
        def hook(_, args, kwargs):
            current[0] = i
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            inputs[i] = sum(a.numel() * a.element_size() for a in tensors if a.is_floating_point())
        return hook

    def post(*_):
        current[0] = -1

    handles = [blk.register_forward_pre_hook(pre(i), with_kwargs=True) for i, blk in enumerate(blocks)]
    handles += [blk.register_forward_hook(post, with_kwargs=True) for blk in blocks]
    ids = torch.zeros(b, t, dtype=torch.long)
    ops = OpCounter(current, len(blocks), set(params), mixed)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), ops, shortened(model, stacks, keep):
            if seq2seq:
                labels = torch.zeros(b, tt, dtype=torch.long)
                logits = model(input_ids=ids, decoder_input_ids=labels, use_cache=False).logits
            else:
                logits, labels = model(input_ids=ids, use_cache=False).logits, ids
            current[0] = -2
            F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    finally:
        for h in handles:
            h.remove()
        split.remove()
    per_block, divided, sequence = [0] * len(blocks), [0] * len(blocks), [0] * len(blocks)
    other = loss = 0
    for nbytes, i, divides in saved.values():
        if i >= 0:
            per_block[i] += nbytes
            divided[i] += nbytes if divides == "tp" else 0
            sequence[i] += nbytes if divides == "sp" else 0
        else:
            other += nbytes
            loss += nbytes if i == -2 else 0
    per_block, divided, sequence, inputs = (widen(v, stacks, keep) for v in (per_block, divided, sequence, inputs))
    block_ops, block_traffic, block_fp32 = (widen(v, stacks, keep) for v in (ops.blocks, ops.block_bytes, ops.block_fp32_flops))
    n = sum(params.values())
    emb = model.get_input_embeddings().weight.numel()
    hidden = _hidden(model.config)
    tokens = b * (t + (tt if seq2seq else 0))
    frozen = frozen_counts(model, blocks)
    root_frozen = frozen.get("frozen_params", 0) - sum(frozen.get("block_frozen", ()))
    matmul, attention = _block_flops(stacks, hidden, t, tt if seq2seq else 0)
    outside = n - emb - sum(block_params)  # the parts outside blocks: on the output side
    head = flop_weight(outside, min(outside, root_frozen)) * (tt if seq2seq else t)
    flops = (sum(matmul) + sum(attention) + head) / (t + (tt if seq2seq else 0))
    return ModelProfile(params=n, embedding_params=emb, largest_unit_params=max(block_params, default=0),
                        root_params=n - sum(block_params), n_blocks=len(blocks), block_saved=per_block,
                        block_inputs=inputs, other_saved=other,
                        logits_bytes=logits.numel() * logits.element_size(), tokens=tokens, flops_per_token=flops,
                        loss_saved=loss, logits_numel=logits.numel(),
                        head_params=model.get_output_embeddings().weight.numel(), matmul_params=_matmul_params(model),
                        block_params=block_params, stacks=[(p, len(s)) for p, s in stacks], **_outside(model),
                        block_tp_params=split.params, block_tp_saved=divided, block_sp_saved=sequence,
                        tp_reduce=[tuple(r) for r in split.reduce], hidden=hidden, vocab_rows=split.vocab_rows,
                        vocab_params=split.vocab_params, block_ops=block_ops, other_ops=ops.other,
                        block_traffic=block_traffic, other_traffic=ops.other_bytes,
                        block_fp32_flops=block_fp32,
                        block_matmul_flops=matmul, block_attention_flops=attention,
                        attention_per_token=sum(attention) / (t + (tt if seq2seq else 0)),
                        vocab=logits.shape[-1], kv_width=_kv_width(model.config),
                        **_tp_counts(model.config, split), **frozen, **base_counts(model))


_CROSS_KV = re.compile(r"(EncDecAttention\.[kv]|encoder_attn\.[kv]_proj)$")  # T5's and BART's cross-attention


def _block_flops(stacks, hidden: int, t: int, tt: int) -> tuple[list[float], list[float]]:
    """Each block's model FLOPs per sample, forward and backward: 6 x its parameters x the tokens it
    computes (4 for a frozen one: adapters.flop_weight), plus 12 x hidden x the query-key pairs of its
    attention (the usual convention). An encoder-decoder's encoder blocks compute the source's t tokens,
    its decoder blocks the target's tt, their cross-attention's keys and values the source's t again
    (with LoRA, the peft layer's base and adapters both)."""
    matmul, attention = [], []
    for i, (_, stack) in enumerate(stacks):
        decoder = tt and i > 0
        for blk in stack:
            kv = module_flop_weight(p for name, m in blk.named_modules() if _CROSS_KV.search(name)
                                    for p in m.parameters()) if decoder else 0.0
            mine = tt if decoder else t
            matmul.append((module_flop_weight(blk.parameters()) - kv) * mine + kv * t)
            attention.append(12.0 * hidden * (tt * tt + tt * t if decoder else t * t))
    return matmul, attention


def _hidden(cfg) -> int:
    return getattr(cfg, "d_model", None) or getattr(cfg, "hidden_size", None) or cfg.n_embd


def _kv_width(cfg) -> int:
    """Key/value heads x head dim (a GQA model's fewer key/value heads; T5's d_kv)."""
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or getattr(cfg, "num_heads", 1)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or getattr(cfg, "d_kv", None) or _hidden(cfg) // heads
    return int(kv * dim)


def _tp_counts(config, split: TensorSplit) -> dict:
    counts, error = split_counts(config)
    return {"tp_counts": counts, "tp_error": error or split.error, "sp_error": sequence_error(config)}


def _outside(model) -> dict:
    """Where a pipeline cut puts the parameters outside the blocks, as layout/split.py decides it."""
    from ..layout.split import anchors  # imported here: it loads strategies, data, torch.distributed.tensor

    try:
        return {"outside": anchors(model)}
    except BigfitError as e:
        return {"pipeline_error": str(e)}


def _matmul_params(model) -> int:
    """Parameters of linear layers (nn.Linear, GPT-2's Conv1D), tied ones once: autocast casts those;
    embedding lookups and norms run on the fp32 weights themselves."""
    linear = {id(p): p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
              for p in m.parameters(recurse=False)}
    return sum(linear.values())
