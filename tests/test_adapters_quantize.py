"""QLoRA (--lora --load-in-4bit, adapters/quantize.py): the refusals, one line each; and the mechanics of the
bitsandbytes store on its CPU path with the CUDA check passed by hand (without CUDA the command
takes torchao's store instead: test_qlora_strategies.py): every LoRA base layer
quantized from the seeded init to exactly bitsandbytes' own NF4 of it, adapters in fp32 training, checkpoints
holding the adapters only and loading back."""
from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")


def settings(model_dir, **kw):
    from bigfit.settings.config import TrainConfig

    values = dict(model=str(model_dir), strategy="single", precision="bf16", lora=True, lora_r=4, lora_dropout=0.0,
                  load_in_4bit=True, batch_size=4, micro_batch_size=4, max_steps=3)
    return TrainConfig(**{**values, **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(lora=False, lora_r=16, lora_dropout=0.05), "--load-in-4bit quantizes a frozen base under LoRA adapters"),
    (dict(strategy="zero3", tp=2), "--load-in-4bit with --tp 2: a 4-bit base is split by FSDP2"),
    (dict(strategy="zero3", pp=2), "--load-in-4bit with --pp 2: a 4-bit base is split by FSDP2"),
    (dict(strategy="pipeline", tp=2), "--load-in-4bit with --tp 2: .* or into whole layers \\(device_map, pipeline\\)"),
    (dict(precision="fp32"), "--load-in-4bit computes in bf16"),
])
def test_qlora_refusals_are_one_line(model_dirs, kw, message):
    from bigfit.job.checks import validate
    from bigfit.errors import BigfitError

    with pytest.raises(BigfitError, match=message.replace("-", r"\-")):
        validate(settings(model_dirs["llama"], **kw))


def test_the_4bit_base_is_the_seeded_init_rounded_and_only_adapters_train_and_checkpoint(model_dirs):
    from bigfit.common.distributed import init_runtime
    from bigfit.adapters.lora import LoraSettings, inject
    from bigfit.models.source import build_model, load_config, locate
    from bigfit.parallel.apply import apply
    from bigfit.job.resolution import resolve
    from bigfit.engine import build_optimizer
    from bigfit.training.step import train_step
    from test_adapters_lora import seeded_base

    with mock.patch("torch.cuda.is_available", return_value=True):  # the command's check, passed by hand
        job = resolve(settings(model_dirs["llama"]), 1)
    cfg = job.cfg
    src = locate(cfg.model)
    model = build_model(src, load_config(src), 0, on_meta=True)
    inject(model, LoraSettings.from_config(cfg))
    rt = init_runtime()
    with warnings.catch_warnings(), mock.patch("torch.cuda.is_available", return_value=True):  # bitsandbytes' store
        warnings.simplefilter("ignore")
        engine = apply(model, job.plan, cfg, rt)
    build_optimizer(engine, cfg)
    assert any("14 base layers in 4 bits" in n and n.endswith("bitsandbytes)") for n in engine.notes)  # 2 blocks x (4 attention + 3 MLP)
    init = seeded_base(model_dirs["llama"])
    layer = model.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(layer, bnb.nn.Linear4bit) and layer.weight.dtype == torch.uint8
    dequant = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    # bitsandbytes' own NF4 (double quantisation) of the seeded init in bf16: the layer holds exactly that
    want = init["model.layers.0.self_attn.q_proj.base_layer.weight"].to(torch.bfloat16)
    q, st = bnb.functional.quantize_4bit(want, quant_type="nf4", compress_statistics=True)
    assert torch.equal(dequant, bnb.functional.dequantize_4bit(q, st)) and not torch.equal(dequant, want)
    batch = [[{"input_ids": list(range(2, 30)), "labels": list(range(2, 30))} for _ in range(4)]]
    losses = [train_step(engine, batch, pad_id=0, seq2seq=False, rt=rt, lr=1e-2, max_grad_norm=1.0)["loss"]
              for _ in range(3)]
    assert losses[-1] < losses[0]
    state = engine.checkpoint_state()
    assert state["model"] and all(".lora_" in k for k in state["model"])  # the 4-bit base is made again
    saved = {k: v.clone() for k, v in state["model"].items()}
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
    engine.after_load({"model": saved, "optim": state["optim"]})
    assert all(torch.equal(dict(model.named_parameters())[k], v) for k, v in saved.items())


def test_a_checkpoint_of_adapters_alone_gives_their_adapter_tensors():
    """A QLoRA checkpoint holds no base weights: its adapter directory needs none."""
    from transformers import LlamaConfig, AutoModelForCausalLM

    from bigfit.outputs.adapter import LoraCheckpoint
    from tiny import tiny_config

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert isinstance(base.config, LlamaConfig)
    path = "model.layers.0.self_attn.q_proj"
    ckpt = LoraCheckpoint({"lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "model": "x"},
                          {f"{path}.lora_A.default.weight", f"{path}.lora_B.default.weight"}, base)
    got = ckpt.adapter_tensors(lambda names: {n: torch.ones(1) for n in names})
    assert set(got) == {f"base_model.model.{path}.lora_A.weight", f"base_model.model.{path}.lora_B.weight"}
