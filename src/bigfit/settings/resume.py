"""What a resumed run may change: pure comparisons of the settings a checkpoint was saved with and
the settings of the run that loads it.

Every TrainConfig field is in exactly one of three groups (a test holds them to that), so a new
setting cannot be forgotten:
- MATH: another value computes something else (another data order, learning rate, loss scale...):
  refused with old and new value unless the user names it in --allow-changed;
- LAYOUT: the same math laid out differently (processes, micro-batches, the strategy, where states
  live): allowed, and said;
- FREE: where files go, how often to save or evaluate, generation settings: allowed silently.
"""
from __future__ import annotations

MATH = ("model", "data", "data_encoding", "data_columns", "data_split", "data_config", "chat_template", "batch_size",
        "seed", "max_source_len", "max_target_len", "pack", "eval_samples", "max_train_samples",
        "max_steps", "optimizer", "lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "lr_schedule",
        "warmup_steps", "warmup_type", "warmup_min_lr", "min_lr", "max_grad_norm", "precision", "reduce_dtype",
        "loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale", "delayed_update",
        "lora", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "load_in_4bit")  # adapters: another model
LAYOUT = ("nproc", "micro_batch_size", "strategy", "device_map", "chunks", "pipeline_schedule", "stages_per_rank",
          "pp", "tp", "dp_shard", "dp_replicate", "sequence_parallel", "cp", "activation_checkpointing", "activations",
          "checkpoint_blocks", "loss_chunk", "compile", "compile_backend", "offload_grads", "nvme_host_gb", "nvme_dir", "ddp_bucket_mb",
          "optimizer_states")  # the moments' format: a checkpoint in another is converted on load
# initial_scale_power: the loss scaler's state is restored from the checkpoint, so it no longer matters
FREE = ("output_dir", "overwrite", "report_to", "data_cache", "dataset_num_proc", "resume", "allow_changed", "save_every", "keep_checkpoints", "eval_every",
        "eval_on_start", "num_beams", "max_new_tokens", "timeout_s", "consolidate", "checkpoints", "probe_only",
        "initial_scale_power")
IDENTITY = ("model", "data")  # compared by content (architecture, file hash), not by the path given


def _differs(saved: dict, now: dict, key: str) -> bool:
    if key == "max_steps" and saved.get("lr_schedule") == now.get("lr_schedule") == "constant":
        return False  # only a decaying schedule reads max_steps
    return key in saved and saved[key] != now.get(key)


def _model_change(saved: dict | None, now: dict | None) -> str | None:
    """The architecture keys that differ (those both configs have: versions of transformers write
    different sets of defaults), or None."""
    if not saved or not now:
        return None
    keys = sorted(k for k in set(saved) & set(now) if saved[k] != now[k])
    return ", ".join(f"{k} {saved[k]!r} -> {now[k]!r}" for k in keys[:4]) + (" ..." if len(keys) > 4 else "") or None


def compare(saved: dict, now: dict, allowed: set[str]) -> tuple[list[str], list[str]]:
    """`saved` and `now`: {"config": settings, "plan": the parallel plan, "world_size": processes, "identity": {"model":,
    "model_config":, "data":, "data_sha256":}} of the checkpoint and of this run (and in `now`,
    "undecided": sizes that a probe picks later, not said yet). Returns (refused,
    notes): 'key old -> new' for every MATH change not in `allowed`, and a line per other change."""
    old, new = saved.get("config", {}), now["config"]
    si, ni = saved.get("identity") or {}, now["identity"]
    changes = {k: f"{k} {old[k]!r} -> {new.get(k)!r}" for k in MATH if k not in IDENTITY and _differs(old, new, k)}
    if model := _model_change(si.get("model_config"), ni.get("model_config")):
        changes["model"] = f"model ({model})"
    elif si.get("base_fingerprint") and si["base_fingerprint"] != ni.get("base_fingerprint"):
        # the checkpoint holds LoRA's adapters alone: its base is the model's files, read again now
        changes["model"] = (f"model (the frozen base's weight files: fingerprint {si['base_fingerprint'][:12]} -> "
                            f"{(ni.get('base_fingerprint') or 'none')[:12]})")
    if si.get("data_sha256") and si["data_sha256"] != ni.get("data_sha256"):
        changes["data"] = f"data (the file's content: sha256 {si['data_sha256'][:12]} -> {ni.get('data_sha256', '')[:12]})"
    elif "data_sha256" not in si and _differs(old, new, "data"):  # saved before data hashes were recorded
        changes["data"] = f"data {old['data']!r} -> {new.get('data')!r}"
    notes = [f"note: {changes[k]} (allowed by --allow-changed)" for k in changes if k in allowed]
    notes += _layout_notes(saved, now, set(changes))
    return [v for k, v in changes.items() if k not in allowed], notes


def _layout_notes(saved: dict, now: dict, changed: set[str]) -> list[str]:
    old, new, notes = saved.get("config", {}), now["config"], []
    if saved.get("world_size") not in (None, now["world_size"]):
        n = now["world_size"]
        notes.append(f"note: resuming at {n} process{'es' if n > 1 else ''}; saved with {saved['world_size']}")
    # the plan beside the settings (checkpoints before the typed job kept it in config.extra)
    was = saved.get("plan") or old.get("extra", {}).get("plan")
    if was and (plan := now.get("plan")) and was != plan:
        notes.append(f"note: resuming as {_degrees(plan)}; saved as {_degrees(was)}")
    for k in LAYOUT:
        if k not in ("nproc", *now.get("undecided", ())) and _differs(old, new, k):
            notes.append(f"note: resuming with {k} {new.get(k)!r}; saved with {old[k]!r}")
    for k, what in (("model", "--model"), ("data", "--data")):
        if k not in changed and k in old and old[k] != new.get(k):
            notes.append(f"note: {what} given as {new.get(k)!r}, saved as {old[k]!r}: the same content")
    return notes


def _degrees(plan: dict) -> str:
    return " x ".join(f"{d} {plan[d]}" for d in ("pp", "dp_replicate", "dp_shard", "tp") if plan.get(d, 1) > 1) or "1 process"
