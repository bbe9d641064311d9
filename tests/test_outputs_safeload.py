"""Checkpoints are data, never code, and a full disk during a save is one line.

A payload (a pickle whose __reduce__ creates a file) is planted in each file bigfit reads from a
checkpoint: rank-N.pt, DCP's .metadata (plainly, and through a module the metadata's classes live in),
a non-tensor entry inside a .distcp, a COMPLETE marker of the older form, a config.json naming code of
its own. The marker is re-sealed over the planted file, as an attacker would (the manifest's CRC-32
finds damage, not intent). `bigfit train --resume`, `bigfit consolidate` and `bigfit.train(resume=...)`
each refuse in one line naming the checkpoint, or load it as data; the payload's file never appears.
"""
from __future__ import annotations

import dataclasses
import io
import json
import pickle
import shlex
import types
from pathlib import Path

import pytest
import torch

import bigfit
from bigfit.cli import main
from bigfit.errors import BigfitError
from bigfit.outputs import manifest
from conftest import bigfit as bigfit_process
from conftest import one_line, snapshot
from dist import run_ranks

NEWEST, OLDER = "step-00000004", "step-00000002"


class Payload:
    """Unpickled, it creates the file `path`: what a crafted checkpoint would run instead."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def through_metadata_module(path: Path) -> bytes:
    """A pickle of os.system reached as an attribute of the module DCP's Metadata is defined in (it
    imports os): refused by an allow-list of modules, run by one that resolves dotted names."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()  # SHORT_BINUNICODE
    return (b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("os.system") + b"\x93"
            + text(f"touch {shlex.quote(str(path))}") + b"\x85R.")  # STACK_GLOBAL, TUPLE1, REDUCE, STOP


def reseal(ckpt: Path) -> None:
    """What an attacker does after planting: a manifest of the files as they are now."""
    body = json.loads((ckpt / "COMPLETE").read_text())
    body.pop("crc32")
    body["files"] = manifest.describe(ckpt, manifest.file_list(ckpt, "COMPLETE"))
    (ckpt / "COMPLETE").write_text(manifest.seal(body))


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def plant_rng(ckpt: Path, mark: Path) -> None:
    (ckpt / "rank-0.pt").write_bytes(torch_saved({"cpu": Payload(mark)}))
    reseal(ckpt)


def plant_metadata(ckpt: Path, mark: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(mark)))
    reseal(ckpt)


def plant_metadata_gadget(ckpt: Path, mark: Path) -> None:
    (ckpt / ".metadata").write_bytes(through_metadata_module(mark))
    reseal(ckpt)


def plant_bytes_entry(ckpt: Path, mark: Path) -> None:
    """The optimizer's learning rate (a non-tensor entry DCP stores torch.save'd) becomes the payload,
    appended to the shard, the metadata pointing at it."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # the file bigfit wrote, before it is tampered with
    shard, payload = ckpt / "__0_0.distcp", torch_saved(Payload(mark))
    index = next(i for i in md.storage_data if i.fqn == "optim.param_groups.0.lr")
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], offset=shard.stat().st_size,
                                                 length=len(payload))
    with open(shard, "ab") as f:
        f.write(payload)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    reseal(ckpt)


def plant_old_marker(ckpt: Path, mark: Path) -> None:
    """The marker's older form, which held no manifest, over a crafted rank-0.pt."""
    (ckpt / "rank-0.pt").write_bytes(torch_saved({"cpu": Payload(mark)}))
    (ckpt / "COMPLETE").write_text('{"step": 4, "world_size": 1}')


NOT_READ = "is not read"
# planted file -> what each entry point says (None: it loads the checkpoint, which is then data)
CASES = {
    "rank-0.pt": (plant_rng, {"resume": "rank-0.pt is not an RNG state", "consolidate": None}),
    ".metadata": (plant_metadata, {"resume": "is no part of DCP's metadata", "consolidate": "is no part of DCP's"}),
    ".metadata-gadget": (plant_metadata_gadget, {"resume": "metadata.os.system", "consolidate": "metadata.os.system"}),
    "bytes-entry": (plant_bytes_entry, {"resume": "'optim.param_groups.0.lr' is not plain data", "consolidate": None}),
    "old-marker": (plant_old_marker, {"resume": "holds no manifest", "consolidate": "holds no manifest"}),
}


def api_settings(args: list[str]) -> dict:
    """bigfit.train's keywords for the command line `args` (flags with values)."""
    return {flag[2:].replace("-", "_"): int(v) if v.isdigit() else v for flag, v in zip(args[1::2], args[2::2])}


def outcome(entry, *args, capsys=None, **kwargs) -> tuple[int | None, str]:
    """(exit status, what it said) of a command (`capsys`: its stderr) or of the Python API (2 and
    the BigfitError's line); (None, the exception) where it failed otherwise."""
    try:
        code = entry(*args, **kwargs)
    except BigfitError as e:
        return 2, str(e)
    except Exception as e:  # before the fix: the payload's object where bigfit expected data
        return None, repr(e)
    return (code if capsys else 0), capsys.readouterr().err if capsys else ""


@pytest.mark.parametrize("planted", list(CASES))
def test_a_planted_payload_runs_nothing_on_resume_consolidate_or_the_api(planted, run_copy, tmp_path, capsys):
    out, args = run_copy
    ckpt, mark = out / "checkpoints" / NEWEST, tmp_path / "payload-ran"
    plant, expected = CASES[planted]
    plant(ckpt, mark)
    said = {"resume": outcome(main, [*args, "--output-dir", str(out), "--resume", str(ckpt)], capsys=capsys),
            "consolidate": outcome(main, ["consolidate", str(ckpt), str(tmp_path / "model")], capsys=capsys),
            "api": outcome(bigfit.train, **api_settings(args), output_dir=str(out), resume=str(ckpt))}
    assert not mark.exists(), f"the payload in {planted} ran: {said}"
    for entry, (code, err) in said.items():
        want = expected["resume" if entry == "api" else entry]
        if want is None:
            assert code == 0, (entry, err)
        else:
            line = one_line(err)
            assert code == 2 and str(ckpt) in line and want in line, (entry, line)


def plant_config(ckpt: Path, mark: Path, config: dict) -> None:
    """config.json naming code of its own (auto_map), which transformers would import from evil.py."""
    (ckpt / "evil.py").write_text(f"open({str(mark)!r}, 'w').close()\n"
                                  "from transformers import PretrainedConfig, PreTrainedModel\n"
                                  "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
                                  "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n")
    (ckpt / "config.json").write_text(json.dumps(config))
    reseal(ckpt)


def vit_config() -> dict:
    from transformers import ViTConfig  # a class transformers has, but no language model of

    return ViTConfig().to_dict()


@pytest.mark.parametrize("config, says", [
    ({"model_type": "evil"}, "no model config transformers has"),
    (None, "describes a 'vit' model"),
], ids=["unknown-type", "known-type-without-lm"])
def test_a_config_naming_its_own_code_runs_nothing_even_if_a_person_says_yes(config, says, run_copy, tmp_path,
                                                                             capsys, monkeypatch):
    """transformers asks on the terminal whether to run a directory's code (15 s to answer);
    someone answers yes: consolidate still runs none."""
    out, _ = run_copy
    ckpt, mark = out / "checkpoints" / NEWEST, tmp_path / "payload-ran"
    auto_map = {k: "evil.EvilModel" for k in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM")}
    plant_config(ckpt, mark, {**(config or vit_config()), "auto_map": {"AutoConfig": "evil.EvilConfig", **auto_map}})
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 4))
    code = main(["consolidate", str(ckpt), str(tmp_path / "model")])
    line = one_line(capsys.readouterr().err)
    assert not mark.exists()
    assert code == 2 and str(ckpt) in line and says in line, line


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_a_model_directory_naming_its_own_code_runs_nothing_on_train(file, model_dirs, pairs_file, tmp_path, capsys,
                                                                    monkeypatch):
    """--model a directory someone shared (a run's OUT/model): its config or tokenizer naming code of
    its own (auto_map) is refused in one line, whatever the person answers transformers' question."""
    model, mark = tmp_path / "model", tmp_path / "payload-ran"
    model.mkdir()
    (model / "evil.py").write_text(f"open({str(mark)!r}, 'w').close()\nfrom transformers import PretrainedConfig\n"
                                   "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
                                   "class EvilTokenizer:\n    pass\n")
    config = json.loads((model_dirs["t5"] / "config.json").read_text())
    if file == "config.json":
        config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    else:
        (model / file).write_text(json.dumps({"tokenizer_class": "EvilTokenizer",
                                              "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
    (model / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 4))
    code = main(["train", "--model", str(model), "--data", str(pairs_file), "--output-dir", str(tmp_path / "out")])
    line = one_line(capsys.readouterr().err)
    assert not mark.exists()
    assert code == 2 and str(model) in line, line


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial(run_copy):
    """The disk fills while DCP writes step 6's shards: exit 2, one line with the room the
    checkpoint needs and the room there is, its .partial removed, the earlier checkpoints intact."""
    out, args = run_copy
    root = out / "checkpoints"
    before = snapshot(root)
    run = bigfit_process(*args, "--output-dir", out, "--resume", "latest", "--max-steps", "6", fault="enospc:6")
    line = one_line(run.stderr)
    assert run.returncode == 2 and str(root / "step-00000006") in line, line
    assert "No space left on device" in line and "needs about" in line and "is free in" in line, line
    assert snapshot(root) == before  # no .partial, no step 6, steps 2 and 4 byte for byte


@pytest.mark.parametrize("file", ["rng", "marker"])
def test_a_full_disk_in_bigfits_own_files_is_the_same_line(file, run_copy, capsys, monkeypatch):
    out, args = run_copy
    root = out / "checkpoints"
    before = snapshot(root)
    monkeypatch.setenv("BIGFIT_FAULT", f"enospc:6:0:{file}")
    code = main([*args, "--output-dir", str(out), "--resume", "latest", "--max-steps", "6"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "step-00000006" in line and "needs about" in line, line
    assert snapshot(root) == before


def _save_on_rank(root: str, fault: str) -> str:
    """checkpoint.save of a small state (1000 floats a rank) on this rank, with BIGFIT_FAULT `fault`."""
    import os

    import torch.distributed as dist

    from bigfit.common.distributed import Runtime
    from bigfit.training import checkpoint

    rank = dist.get_rank()
    rt = Runtime(rank=rank, world_size=dist.get_world_size(), local_rank=rank, device=torch.device("cpu"))
    engine = types.SimpleNamespace(checkpoint_state=lambda: {"model": {f"w{rank}": torch.zeros(1000)}},
                                   frozen_in_checkpoints=True)
    os.environ["BIGFIT_FAULT"] = fault
    try:
        checkpoint.save(Path(root), 1, engine, rt, {"config": {}}, lambda _: None)
        return "saved"
    except BigfitError as e:
        return str(e)
    finally:
        del os.environ["BIGFIT_FAULT"]


@pytest.mark.parametrize("file", ["shards", "rng"])
def test_a_full_disk_on_one_rank_ends_every_rank(file, tmp_path):
    """Rank 1 finds the disk full, in DCP's writer (a collective) or in its own rank-1.pt (a write
    rank 0 does not share): both ranks end with the same line, none waits in a barrier."""
    said = run_ranks(_save_on_rank, 2, str(tmp_path), f"enospc:1:1:{file}", timeout_s=60)
    assert said[0] == said[1] and "needs about 12.1 KB" in said[0], said
    assert list(tmp_path.iterdir()) == []


def test_torchs_zip_writer_cut_short_is_a_full_disk_too():
    """torch.save to a path on a full disk, and DCP's writer inside, end with a RuntimeError, not an
    OSError (torch 2.13, a 64 KiB tmpfs): it is the disk's failure all the same; a bug is not."""
    from torch.distributed.checkpoint.api import CheckpointException

    from bigfit.training.savefail import disk_reason

    cut = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert "unexpected pos 704 vs 598" in disk_reason(CheckpointException("write", {1: (cut, [])}))
    assert disk_reason(OSError(122, "Disk quota exceeded")) == "Disk quota exceeded"
    assert disk_reason(RuntimeError("expected a tensor")) is None
