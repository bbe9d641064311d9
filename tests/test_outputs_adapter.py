"""What a `--lora` run leaves: checkpoints of the adapters alone; `bigfit consolidate` writes a peft
adapter directory (what PeftModel.save_pretrained writes, loaded by PeftModel.from_pretrained) and
with --merge a model that transformers alone loads, its base read again from the run's --model (or
--base, where that moved); both give the same logits."""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bigfit.cli import main
from conftest import one_line, snapshot
from tiny import tiny_config

# fp32 on the CPU: the adapter's two small matmuls beside the merged weight's one differ by rounding only
RTOL, ATOL = 1e-5, 1e-6
PREFIX, A_KEY = "base_model.model.", ".lora_A.weight"
TARGETS = {"llama": "q_proj,v_proj", "gpt2": "all-linear", "t5": "all-linear"}  # names, and peft's shorthand


@dataclass
class Outputs:
    base: Path  # the tiny base model, with weights
    ckpt: Path  # the LoRA run's last checkpoint
    adapter: Path  # bigfit consolidate CKPT ADAPTER
    merged: Path  # bigfit consolidate CKPT MERGED --merge


def auto(family: str):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if family == "t5" else AutoModelForCausalLM


@pytest.fixture(scope="session")
def lora_outputs(tmp_path_factory, pairs_file):
    """family -> its Outputs, trained and consolidated on first use (each test takes the families it needs)."""
    made: dict[str, Outputs] = {}

    def make(family: str) -> Outputs:
        if family not in made:
            root = tmp_path_factory.mktemp(f"lora-{family}")
            torch.manual_seed(0)
            auto(family).from_config(tiny_config(family)).save_pretrained(root / "base")  # safetensors
            assert main(["train", "--model", str(root / "base"), "--data", str(pairs_file), "--strategy", "single",
                         "--lora", "--lora-r", "4", "--lora-alpha", "8", "--lora-targets", TARGETS[family],
                         "--max-steps", "3", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "0",
                         "--lr-schedule", "constant", "--eval-samples", "0", "--no-consolidate",
                         "--output-dir", str(root / "out")]) == 0
            o = Outputs(root / "base", root / "out" / "checkpoints" / "step-00000003", root / "adapter",
                        root / "merged")
            assert main(["consolidate", str(o.ckpt), str(o.adapter)]) == 0
            assert main(["consolidate", str(o.ckpt), str(o.merged), "--merge"]) == 0
            made[family] = o
        return made[family]
    return make


def logits(model, family: str) -> torch.Tensor:
    ids = torch.randint(2, 384, (2, 12), generator=torch.Generator().manual_seed(1))
    extra = {"decoder_input_ids": ids[:, :7]} if family == "t5" else {}
    with torch.no_grad():
        return model.eval()(input_ids=ids, **extra).logits


def adapted_paths(adapter: Path) -> set[str]:
    """The module paths that carry adapters, read from peft's keys."""
    keys = load_file(adapter / "adapter_model.safetensors")
    return {k[len(PREFIX):-len(A_KEY)] for k in keys if k.endswith(A_KEY)}


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_the_adapter_loads_with_peft_and_gives_the_merged_models_logits(lora_outputs, family):
    from peft import PeftModel

    o = lora_outputs(family)
    with warnings.catch_warnings():  # GPT-2: peft's note on Conv1D's fan_in_fan_out
        warnings.simplefilter("ignore", UserWarning)
        peft_model = PeftModel.from_pretrained(auto(family).from_pretrained(o.base), o.adapter)
    merged, base = auto(family).from_pretrained(o.merged), auto(family).from_pretrained(o.base)
    assert not (o.merged / "adapter_config.json").exists()  # transformers alone: a plain model directory
    got, want = logits(peft_model, family), logits(merged, family)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(want, logits(base, family), rtol=1e-3, atol=1e-4)  # the adapters did something


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_the_adapter_is_in_peft_format_and_trained(lora_outputs, family):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    o = lora_outputs(family)
    saved = load_file(o.adapter / "adapter_model.safetensors")
    config = LoraConfig.from_pretrained(o.adapter)
    assert (config.r, config.lora_alpha, config.task_type) == (4, 8, "SEQ_2_SEQ_LM" if family == "t5" else "CAUSAL_LM")
    assert config.fan_in_fan_out == (family == "gpt2") and config.base_model_name_or_path == str(o.base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fresh = get_peft_model(auto(family).from_pretrained(o.base), config)
    want = get_peft_model_state_dict(fresh)  # what PeftModel.save_pretrained would write
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in want.items()}
    assert all(v.any() for k, v in saved.items() if ".lora_B." in k)  # zero at init: training moved each
    assert not (o.adapter / "config.json").exists()


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_merging_changes_only_the_targeted_weights(lora_outputs, family):
    o = lora_outputs(family)
    base = load_file(o.base / "model.safetensors")
    merged = load_file(o.merged / "model.safetensors")
    assert set(merged) == set(base)
    targeted = {p + ".weight" for p in adapted_paths(o.adapter)}
    if family == "llama":
        assert {t.rsplit(".", 2)[1] for t in targeted} == {"q_proj", "v_proj"} and len(targeted) == 4
    assert targeted and targeted <= set(base)
    for name, t in base.items():
        assert (not torch.equal(merged[name], t)) == (name in targeted), name


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model's tensors in a DCP checkpoint, read with DCP alone (names without "model.")."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    out = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()
           if k.startswith("model.") and hasattr(v, "size")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, checkpoint_id=str(ckpt), no_dist=True)
    return {k[len("model."):]: t for k, t in out.items()}


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_the_checkpoint_holds_the_adapters_alone(lora_outputs, family):
    from bigfit.outputs.ckptdir import trainer_state

    o = lora_outputs(family)
    held, base = checkpoint_tensors(o.ckpt), load_file(o.base / "model.safetensors")
    assert set(held) == {f"{p}.lora_{x}.default.weight" for p in adapted_paths(o.adapter) for x in "AB"}
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert nbytes(held.values()) < nbytes(base.values()) / 4  # llama 4%, gpt2 and t5 (all-linear) 9% and 11%
    assert trainer_state(o.ckpt)["frozen"] == {"in_checkpoint": False, "source": str(o.base.resolve()),
                                                 "init_device": "cpu"}


def test_merge_names_a_base_that_moved_and_reads_it_from_base(lora_outputs, tmp_path, capsys):
    o = lora_outputs("llama")
    capsys.readouterr()
    moved = tmp_path / "moved"
    o.base.rename(moved)
    try:
        assert main(["consolidate", str(o.ckpt), str(tmp_path / "m"), "--merge"]) == 2
        line = one_line(capsys.readouterr().err)
        assert str(o.base) in line and "--base DIR" in line and "without --merge" in line
        assert main(["consolidate", str(o.ckpt), str(tmp_path / "m"), "--merge", "--base", str(moved)]) == 0
    finally:
        moved.rename(o.base)
    assert snapshot(tmp_path / "m")["model.safetensors"] == snapshot(o.merged)["model.safetensors"]
    assert main(["consolidate", str(o.ckpt), str(tmp_path / "a"), "--base", str(o.base)]) == 2
    assert "--base" in one_line(capsys.readouterr().err) and not (tmp_path / "a").exists()


def test_merge_of_a_full_fine_tuning_checkpoint_is_one_line(finished_run, tmp_path, capsys):
    out, _ = finished_run
    assert main(["consolidate", str(out / "checkpoints" / "step-00000004"), str(tmp_path / "m"), "--merge"]) == 2
    assert "--merge is for LoRA checkpoints" in one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_an_adapter_directory_is_replaced_only_with_overwrite_and_keeps_other_files(lora_outputs, tmp_path, capsys):
    o = lora_outputs("llama")
    capsys.readouterr()  # the fixture's first use saves the base model: transformers' progress bar, not ours
    target = tmp_path / "adapter"
    assert main(["consolidate", str(o.ckpt), str(target)]) == 0
    marker = json.loads((target / "bigfit-model.json").read_text())
    assert marker["kind"] == "adapter" and sorted(marker["files"]) == sorted(
        p.name for p in target.iterdir() if p.name != "bigfit-model.json")
    (target / "NOTES.md").write_text("my notes")
    before = snapshot(target)
    assert main(["consolidate", str(o.ckpt), str(target)]) == 2
    assert "--overwrite" in one_line(capsys.readouterr().err)
    assert snapshot(target) == before
    assert main(["consolidate", str(o.ckpt), str(target), "--merge", "--overwrite"]) == 0  # the adapter's files go
    assert (target / "NOTES.md").read_text() == "my notes" and not (target / "adapter_config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]
