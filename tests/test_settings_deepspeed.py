"""DeepSpeed JSON configs -> bigfit settings: a pure mapping, no torch work."""
from __future__ import annotations

import copy
import json

import pytest

from bigfit.errors import BigfitError
from bigfit.job.checks import validate
from bigfit.settings.config import TrainConfig
from bigfit.settings.deepspeed import load_deepspeed_config, map_deepspeed

# The ZeRO-2 / ZeRO-3 configs the Hugging Face Trainer documentation hands out: "auto" everywhere it can.
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
ZERO3 = {
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "tensorboard": {"enabled": True, "output_path": "runs/"},
}


def errors(ds: dict, world_size: int = 1) -> str:
    with pytest.raises(BigfitError) as e:
        map_deepspeed(ds, world_size)
    return str(e.value)


def test_hf_trainer_zero2_offload_leaves_auto_values_to_bigfit():
    m = map_deepspeed(HF_ZERO2, world_size=2)
    assert m.strategy == "zero2-offload"
    assert m.values == {"strategy": "zero2-offload", "loss_scale": 0, "loss_scale_window": 1000,
                        "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1, "optimizer": "adamw",
                        "lr_schedule": "constant", "warmup_type": "log"}
    assert m.ignored == ["steps_per_print", "wall_clock_breakdown"]
    assert m.automatic == ["zero_optimization.allgather_bucket_size", "zero_optimization.allgather_partitions",
                           "zero_optimization.contiguous_gradients", "zero_optimization.offload_optimizer.pin_memory",
                           "zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size",
                           "zero_optimization.reduce_scatter"]
    assert m.summary == "DeepSpeed config -> strategy zero2-offload, precision from bigfit, batch sizes from bigfit"


def test_zero3_with_param_offload():
    m = map_deepspeed(ZERO3, world_size=2)
    assert m.strategy == "zero3-offload"
    assert m.summary == ("DeepSpeed config -> strategy zero3-offload, precision fp16 (dynamic loss scale 2**16, "
                         "window 1000, hysteresis 2, min 1), micro-batch 4 x accumulation 2 x 2 processes "
                         "= global batch 16")
    v = m.values
    assert (v["precision"], v["batch_size"], v["micro_batch_size"], v["max_grad_norm"]) == ("fp16", 16, 4, 1.0)
    assert (v["lr"], v["adam_beta1"], v["adam_beta2"], v["adam_eps"], v["weight_decay"]) == (3e-4, 0.9, 0.95, 1e-8, 0.1)
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" in m.automatic
    assert "zero_optimization.offload_param.pin_memory" in m.automatic
    assert "zero_optimization.reduce_bucket_size" not in m.automatic + m.ignored  # "auto": not set here
    assert m.ignored == ["tensorboard.enabled", "tensorboard.output_path"]


@pytest.mark.parametrize("zero,strategy,note", [
    (None, "ddp", None),
    ({"stage": 0}, "ddp", None),
    ({"stage": 1}, "zero1", None),
    ({"stage": 2}, "zero2", None),
    ({"stage": 3}, "zero3", None),
    ({"overlap_comm": True}, "ddp", None),  # DeepSpeed's default stage is 0
    ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, "zero2-offload", "runs as zero2-offload"),
    ({"stage": 2, "offload_optimizer": {"device": "none"}}, "zero2", None),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "zero3-offload", "also keeps parameters in host RAM"),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, "zero3-offload", "also keeps optimizer state in host RAM"),
    ({"stage": "auto"}, "auto", None),
])
def test_zero_stage_and_offload_pick_the_strategy(zero, strategy, note):
    m = map_deepspeed({} if zero is None else {"zero_optimization": zero}, world_size=4)
    assert m.strategy == strategy
    assert m.values.get("strategy") == (None if strategy == "auto" else strategy)
    assert (note in m.summary) if note else (";" not in m.summary)


def test_old_cpu_offload_keys():
    assert map_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": True}}, 1).strategy == "zero2-offload"
    both = {"stage": 3, "cpu_offload": True, "cpu_offload_params": True, "cpu_offload_use_pin_memory": True}
    m = map_deepspeed({"zero_optimization": both}, 1)
    assert (m.strategy, m.automatic) == ("zero3-offload", ["zero_optimization.cpu_offload_use_pin_memory"])
    assert "host RAM" not in m.summary
    assert map_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": False}}, 1).strategy == "zero2"


@pytest.mark.parametrize("ds,world,needles", [
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, 1,
     ["zero_optimization.offload_param", "zero_optimization.stage", "stage 3"]),
    ({"zero_optimization": {"stage": 1, "cpu_offload_params": True}}, 1,
     ["zero_optimization.cpu_offload_params", "zero_optimization.stage"]),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, 1,
     ["zero_optimization.offload_optimizer", "zero_optimization.stage"]),
    ({"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "cpu"}}}, 1,
     ["zero_optimization.offload_optimizer", "zero_optimization.stage"]),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, 1, ["fp16.enabled", "bf16.enabled"]),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
     ["train_batch_size 32", "train_micro_batch_size_per_gpu 4", "gradient_accumulation_steps 2",
      "world_size 2", "= 16"]),
])
def test_contradictions_name_the_keys(ds, world, needles):
    msg = errors(ds, world)
    assert all(n in msg for n in needles), msg


def test_nvme_offload():
    m = map_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                                               "nvme_path": "/local_nvme"}}}, 2)
    assert (m.strategy, m.values["nvme_dir"]) == ("zero2-offload-nvme", "/local_nvme")
    msg = errors({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})
    assert "zero_optimization.offload_optimizer 'nvme' with zero_optimization.stage 3" in msg and "stage 2" in msg
    msg = errors({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}})
    assert "zero_optimization.offload_param.device 'nvme'" in msg and "host RAM only" in msg


@pytest.mark.parametrize("ds,needle", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage 4 is not valid"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device 'gpu' is not valid"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled must be true, false"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, "optimizer.params.lr must be a number"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "optimizer.params.betas must be a list"),
    ({"fp16": {"enabled": True, "hysteresis": 1.5}}, "fp16.hysteresis must be an integer"),
    ({"zero_optimization": 3}, "zero_optimization must be a JSON object"),
])
def test_bad_values_name_the_key(ds, needle):
    assert needle in errors(ds)


@pytest.mark.parametrize("given,world,expect", [
    (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 2, (16, 4, 2)),
    (dict(train_batch_size=24, train_micro_batch_size_per_gpu=3), 2, (24, 3, 4)),
    (dict(train_batch_size=24, gradient_accumulation_steps=3), 2, (24, 4, 3)),
    (dict(train_batch_size=16, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2), 4, (16, 2, 2)),
])
def test_batch_sizes_derive_the_missing_one(given, world, expect):
    m = map_deepspeed(given, world)
    b, micro, accum = expect
    assert (m.values["batch_size"], m.values["micro_batch_size"]) == (b, micro)
    assert f"micro-batch {micro} x accumulation {accum} x {world} processes = global batch {b}" in m.summary
    cfg = TrainConfig(**m.values)
    validate(cfg)


def test_batch_sizes_given_alone():
    only_b = map_deepspeed({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto"}, 4)
    assert (only_b.values["batch_size"], "micro_batch_size" in only_b.values) == (64, False)
    only_m = map_deepspeed({"train_micro_batch_size_per_gpu": 8}, 4)
    assert (only_m.values["micro_batch_size"], "batch_size" in only_m.values) == (8, False)
    alone = map_deepspeed({"gradient_accumulation_steps": 4}, 4)  # bigfit has no accumulation setting of its own
    assert (alone.values, alone.ignored) == ({"strategy": "ddp"}, ["gradient_accumulation_steps"])


@pytest.mark.parametrize("given,needle", [
    (dict(train_batch_size=30, train_micro_batch_size_per_gpu=4),
     "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 x world_size 2 = 8"),
    (dict(train_batch_size=30, gradient_accumulation_steps=4),
     "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 x world_size 2 = 8"),
    (dict(train_batch_size=0), "train_batch_size must be at least 1"),
    (dict(train_micro_batch_size_per_gpu=2.5), "train_micro_batch_size_per_gpu must be an integer"),
])
def test_batch_sizes_that_do_not_divide(given, needle):
    assert needle in errors(given, world_size=2)


@pytest.mark.parametrize("optimizer,expect", [
    ({"type": "Adam", "params": {"lr": 1e-4}}, "adamw"),  # DeepSpeed's adam_w_mode defaults to true
    ({"type": "Adam", "params": {"adam_w_mode": False}}, "adam"),
    ({"type": "adamw", "params": {"adam_w_mode": False}}, "adamw"),  # AdamW is always decoupled
    ({"type": "ADAM"}, "adamw"),
])
def test_optimizer_types(optimizer, expect):
    assert map_deepspeed({"optimizer": optimizer}, 1).values["optimizer"] == expect


def test_optimizer_params_and_unsupported_types():
    m = map_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.8, 0.99],
                                                                  "torch_adam": True, "amsgrad": False}}}, 1)
    assert m.values == {"strategy": "ddp", "optimizer": "adamw", "lr": 2e-5, "adam_beta1": 0.8, "adam_beta2": 0.99}
    assert m.ignored == ["optimizer.params.amsgrad", "optimizer.params.torch_adam"]
    msg = errors({"optimizer": {"type": "OneBitLamb", "params": {}}})
    assert "OneBitLamb" in msg and "Adam, AdamW" in msg


def test_warmup_lr_defaults_to_log_warmup_and_its_max_lr_wins():
    # the scheduler comes first in the file: warmup_max_lr must still win over optimizer.params.lr
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-4,
                                                       "warmup_num_steps": 100, "last_batch_iteration": -1}},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    m = map_deepspeed(ds, 1)
    assert m.values == {"strategy": "ddp", "optimizer": "adamw", "lr": 5e-4, "lr_schedule": "constant",
                        "warmup_type": "log", "warmup_min_lr": 0, "warmup_steps": 100}
    assert "warmup_max_lr 0.0005 overrides optimizer.params.lr 0.001" in m.summary
    assert m.ignored == ["scheduler.params.last_batch_iteration"]
    ds["scheduler"]["params"].update(warmup_type="linear", warmup_max_lr=1e-3)
    m = map_deepspeed(ds, 1)
    assert m.values["warmup_type"] == "linear" and "overrides" not in m.summary


def test_warmup_decay_and_cosine_set_max_steps():
    decay = map_deepspeed({"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_max_lr": 1e-4, "warmup_num_steps": 10, "total_num_steps": 500, "warmup_type": "linear"}}}, 1)
    assert decay.values == {"strategy": "ddp", "lr_schedule": "linear", "lr": 1e-4, "warmup_steps": 10,
                            "max_steps": 500, "warmup_type": "linear"}
    # WarmupCosineLR takes its peak from the optimizer and reads no warmup_min_lr / warmup_max_lr
    cosine = map_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
                            "scheduler": {"type": "WarmupCosineLR", "params": {
                                "warmup_num_steps": 5, "total_num_steps": 300, "warmup_min_ratio": 0.1,
                                "cos_min_ratio": 0.01, "warmup_max_lr": 1e-3}}}, 1)
    assert cosine.values == {"strategy": "ddp", "optimizer": "adamw", "lr": 2e-4, "lr_schedule": "cosine",
                             "warmup_type": "log", "warmup_steps": 5, "max_steps": 300}
    assert cosine.ignored == ["scheduler.params.cos_min_ratio", "scheduler.params.warmup_max_lr",
                              "scheduler.params.warmup_min_ratio"]
    hf = map_deepspeed({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}, 1)
    assert "max_steps" not in hf.values
    floor = map_deepspeed({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-6}}}, 1)
    assert floor.values["min_lr"] == floor.values["warmup_min_lr"] == 1e-6  # decays back down to it


@pytest.mark.parametrize("scheduler,needle", [
    ({"type": "OneCycle", "params": {}}, "WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}, "scheduler.params.warmup_type"),
])
def test_bad_schedulers(scheduler, needle):
    assert needle in errors({"scheduler": scheduler})


@pytest.mark.parametrize("ds,precision", [
    ({"bf16": {"enabled": True}}, "bf16"),
    ({"bfloat16": {"enabled": True}}, "bf16"),
    ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, "fp32"),
    ({"fp16": {"enabled": False}}, "fp32"),
    ({"fp16": {"enabled": False}, "bf16": {"enabled": "auto"}}, None),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": True}}, "bf16"),
    ({}, None),
])
def test_precision(ds, precision):
    assert map_deepspeed(ds, 1).values.get("precision") == precision


def test_fp16_loss_scaling():
    m = map_deepspeed({"fp16": {"enabled": True, "loss_scale": 128, "consecutive_hysteresis": False,
                                "auto_cast": False}, "communication_data_type": "bf16"}, 1)
    assert m.values == {"strategy": "ddp", "precision": "fp16", "loss_scale": 128, "reduce_dtype": "bf16"}
    assert "precision fp16 (static loss scale 128)" in m.summary
    assert m.ignored == ["fp16.auto_cast", "fp16.consecutive_hysteresis"]
    off = map_deepspeed({"fp16": {"enabled": False, "hysteresis": 4}}, 1)  # kept for a later --precision fp16
    assert off.values == {"strategy": "ddp", "precision": "fp32", "hysteresis": 4}
    assert "communication_data_type" in errors({"communication_data_type": "int8"})


def test_ignored_and_automatic_keys():
    ds = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "overlap_comm": True,
                                "zero_quantized_weights": False},
          "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False},
          "amp": {"enabled": False}, "flops_profiler": {}, "wandb": {"enabled": True, "project": "x"},
          "prescale_gradients": False, "zero_allow_untested_optimizer": True}
    m = map_deepspeed(ds, 2)
    assert m.values == {"strategy": "zero1", "ddp_bucket_mb": 5e8 / 2**20}
    assert m.automatic == ["zero_optimization.overlap_comm"]
    assert m.ignored == ["activation_checkpointing.cpu_checkpointing", "activation_checkpointing.partition_activations",
                         "amp.enabled", "flops_profiler", "prescale_gradients", "wandb.enabled", "wandb.project",
                         "zero_allow_untested_optimizer", "zero_optimization.zero_quantized_weights"]
    stage2 = map_deepspeed({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}, 2)
    assert "ddp_bucket_mb" not in stage2.values and stage2.automatic == ["zero_optimization.reduce_bucket_size"]


@pytest.mark.parametrize("ds", [HF_ZERO2, ZERO3, {
    "train_batch_size": 32, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}, "communication_data_type": "fp32",
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}}}])
def test_values_are_train_config_fields_that_validate(ds):
    m = map_deepspeed(copy.deepcopy(ds), world_size=2)
    assert set(m.values) <= set(TrainConfig.field_names())
    validate(TrainConfig(**m.values))


def test_load_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO3))
    m = load_deepspeed_config(str(path), world_size=2)
    assert m.summary.startswith(f"DeepSpeed config {path} -> strategy zero3-offload")
    for text, needle in (("{not json", "is not valid JSON"), ("[1, 2]", "must be a JSON object")):
        path.write_text(text)
        with pytest.raises(BigfitError, match=needle):
            load_deepspeed_config(str(path), 1)
    with pytest.raises(BigfitError, match="does not exist"):
        load_deepspeed_config(str(tmp_path / "missing.json"), 1)
