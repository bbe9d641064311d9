"""Every setting is typed and every file a user names is read with care: a mistake is one line naming the
bad value (or file, line and byte) and what would be valid, exit status 2, before any work starts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bigfit.cli import config_from_args, main, parse_args
from bigfit.data import read_examples
from bigfit.errors import BigfitError
from bigfit.job.checks import validate
from bigfit.settings.config import TrainConfig
from bigfit.settings.reading import load_config_file

# An invalid flag that stops a job in `validate`, before any work, if the mistake under test got through
# (before these checks several did, and a test must not start training to find that out).
TRIPWIRE = ["--keep-checkpoints", "-1"]
LATIN1 = '{"source": "a", "target": "b"}\n{"source": "caf\xe9", "target": "b"}\n'.encode("latin-1")


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def train(capsys, tmp_path, *argv, tripwire: bool = True) -> str:
    """`bigfit train ARGV` in this process: its one error line (exit status 2, nothing written)."""
    assert main(["train", *argv, "--output-dir", str(tmp_path / "out"), *(TRIPWIRE if tripwire else [])]) == 2
    assert not (tmp_path / "out").exists()
    return one_line(capsys.readouterr().err)


FILE_CASES = [  # (config file text, the error after "config file 'PATH': ")
    ("batch_size: ten\n", "batch_size 'ten' is not an integer (give a whole number, or auto)"),
    ("lr: fast\n", "lr 'fast' is not a number (give a number such as 0.001)"),
    ('activation_checkpointing: "no"\n',  # quoted, so not YAML's false: it used to switch checkpointing on
     "activation_checkpointing 'no' is not true or false (write true or false, unquoted)"),
    ("max_steps: 5.5\n", "max_steps 5.5 is not an integer (give a whole number)"),
    ("max_steps: true\n", "max_steps True is not an integer (give a whole number)"),
    ("chunks:\n  - 2\n", "chunks [2] is not an integer (give a whole number, or null)"),
    ("max_steps:\n", "max_steps null is not an integer (give a whole number)"),
    ("output_dir: 2024\n", "output_dir 2024 is not a string (give text in quotes)"),
    ("lr: .nan\n", "lr nan is not a number (give a number such as 0.001)"),
    ("max-steps: 4\nmax_steps: 5\n", "max-steps and max_steps are the same setting; keep one"),
]


@pytest.mark.parametrize("text,needle", FILE_CASES, ids=[c[0].split(":")[0] for c in FILE_CASES])
def test_config_file_values_are_typed(capsys, tmp_path, text, needle):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    assert train(capsys, tmp_path, "--config", str(f)) == f"error: config file {str(f)!r}: {needle}"


def test_a_yaml_syntax_error_is_one_line(capsys, tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("max_steps: 3\nbatch_size 4\nlr: [\n")  # PyYAML's own message quotes each line under a caret
    assert train(capsys, tmp_path, "--config", str(f)) == (
        f"error: config file {str(f)!r} is not valid yaml: line 3, column 1: could not find expected ':' (while "
        "scanning a simple key, from line 2)")


def test_config_file_values_that_read_as_their_type(tmp_path):
    """PyYAML leaves 1e-3 and 1e1 as strings (YAML 1.1); 6.0 steps is 6; "auto" only where it means something."""
    f = tmp_path / "run.yaml"
    f.write_text("lr: 1e-3\nmax_steps: 6.0\nwarmup_steps: 1e1\nloss_scale: 0\nnproc: auto\nstrategy: device_map\n"
                 "device_map: auto\nbatch_size: auto\n")
    cfg = config_from_args(parse_args(["train", "--config", str(f)]))
    assert (cfg.lr, cfg.max_steps, cfg.warmup_steps, cfg.loss_scale) == (0.001, 6, 10, 0.0)
    assert [type(v) for v in (cfg.lr, cfg.max_steps, cfg.warmup_steps, cfg.loss_scale)] == [float, int, int, float]
    assert (cfg.nproc, cfg.device_map, cfg.batch_size) == (None, "auto", "auto")


def test_unknown_keys_get_the_closest_setting_and_internal_ones_are_refused(capsys, tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("batchsize: 4\nmax-step: 3\n")
    err = train(capsys, tmp_path, "--config", str(f))
    assert "unknown setting(s) 'batchsize' (did you mean batch_size?), 'max-step' (did you mean max_steps?)" in err
    assert "valid:" not in err  # every key had a suggestion: no list of 50 settings to read through
    f.write_text("probe_only: true\n")
    err = train(capsys, tmp_path, "--config", str(f))
    assert "unknown setting(s) 'probe_only'" in err and "valid: model, data," in err
    assert "probe_only" not in err.split("valid:")[1] and "extra" not in err.split("valid:")[1]
    assert parse_args(["train", "--probe-only"]).probe_only is True  # the launcher's own flag still works


def test_a_trainconfig_built_in_python_is_typed_too():
    for kw, needle in ((dict(max_steps="10"), "setting max_steps '10' is not an integer"),
                       (dict(lr=float("nan")), "setting lr nan is not a number"),
                       (dict(compile=1), "setting compile 1 is not true or false")):
        with pytest.raises(BigfitError, match=needle):
            validate(TrainConfig(**kw))
    validate(TrainConfig(lr=1, batch_size="auto"))  # an int is a float; batch_size takes auto


PARSER_CASES = [  # argv, stderr's one line
    (["train", "--max-steps", "5.5"], "error: argument --max-steps: '5.5' is not an integer (give a whole number)"),
    (["train", "--max-steps", "auto"], "error: argument --max-steps: cannot be 'auto'; settings that can: nproc"),
    (["train", "--batch-size", "ten"],
     "error: argument --batch-size: 'ten' is not an integer (give a whole number, or auto)"),
    (["train", "--lr", "inf"], "error: argument --lr: 'inf' is not a number (give a number such as 0.001)"),
    (["train", "--max-stepz", "5"], "error: unrecognized arguments: --max-stepz 5; did you mean --max-steps?"),
    (["plan", "--nodes", "two"], "error: argument --nodes: 'two' is not an integer (give a whole number)"),
    (["plan", "--precision", "fp8"], "error: argument --precision: invalid choice: 'fp8' (choose from"),
    (["trian"], "error: argument {train,plan,bench,consolidate}: invalid choice: 'trian' (choose from"),
    ([], "error: the following arguments are required: {train,plan,bench,consolidate}"),
]


@pytest.mark.parametrize("argv,line", PARSER_CASES, ids=[" ".join(c[0][:2]) or "none" for c in PARSER_CASES])
def test_command_line_mistakes_are_one_line(capsys, argv, line):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert one_line(capsys.readouterr().err).startswith(line)


def test_flags_read_as_their_type():
    ns = parse_args(["train", "--max-steps", "1e3", "--lr", "2e-4", "--nproc", "auto", "--micro-batch-size", "auto"])
    assert (ns.max_steps, ns.lr, ns.nproc, ns.micro_batch_size) == (1000, 2e-4, None, "auto")


def test_processes_exit_2_with_one_line_and_help_still_works(tmp_path):
    """In a real process (argparse exits through SystemExit there); the in-process cases above cover the rest."""
    r = subprocess.run([sys.executable, "-m", "bigfit", "train", "--max-steps", "5.5", "--output-dir",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error: argument --max-steps: '5.5' is not an integer" in one_line(r.stderr)
    r = subprocess.run([sys.executable, "-m", "bigfit", "train", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: bigfit")


def test_a_flags_mistake_is_said_before_torch_loads():
    """The flags' checks need no torch (1-2 s to import; the training stack 5 s): a mistake, a --data file
    that is not there or --help answers at once."""
    code = ("import sys; from bigfit.cli import main\n"
            "for argv in (['train', '--strategy', 'pipedream'], ['train', '--lora-r', '0'], ['plan', '--help'],\n"
            "             ['train', '--data', 'missing/pairs.jsonl']):\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "[]", r.stdout + r.stderr
    assert "strategy 'pipedream' is not valid" in r.stderr and "--lora-r" in r.stderr
    assert "--data 'missing/pairs.jsonl' does not exist" in r.stderr


DATA_CASES = [  # file name, bytes, the error after "--data 'PATH'"
    ("pairs.jsonl", LATIN1, " line 2: 0xe9 at byte offset 46 is not valid utf-8 (invalid continuation byte); if the "
     "file is in another encoding, name it with --data-encoding (e.g. --data-encoding latin-1)"),
    ("pairs.csv", b"source,target\nhello,world\ncaf\xe9,x\n", " line 3: 0xe9 at byte offset 29 is not valid utf-8"),
    ("corpus.txt", b"one\ntwo \xff\xfe\n", " line 2: 0xff at byte offset 8 is not valid utf-8"),  # was replaced
    ("cut.txt", b"ok \xc3", " line 1: 0xc3 at byte offset 3 is not valid utf-8 (unexpected end of data)"),
    ("empty.jsonl", b"", " is empty; give a file of examples"),
    ("long.csv", b"text\n" + b"x" * 200_000 + b"\n", " line 2: not readable as CSV (field larger than field limit"),
]


@pytest.mark.parametrize("name,data,needle", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_data_files_that_do_not_read_are_one_line(tmp_path, name, data, needle):
    f = tmp_path / name
    f.write_bytes(data)
    with pytest.raises(BigfitError) as e:
        read_examples(str(f))
    assert str(e.value).startswith(f"--data {str(f)!r}{needle}")


def test_data_encoding_reads_other_encodings_and_unknown_ones_are_one_line(capsys, tmp_path, monkeypatch):
    f = tmp_path / "pairs.jsonl"
    f.write_bytes(LATIN1)
    assert read_examples(str(f), "latin-1")[1] == {"source": "caf\xe9", "target": "b"}
    f.write_bytes(LATIN1.decode("latin-1").encode("utf-16"))
    assert read_examples(str(f), "utf-16")[1] == {"source": "caf\xe9", "target": "b"}
    with pytest.raises(BigfitError, match=r"--data-encoding 'utf9' is not a text encoding Python knows; did you "
                                          r"mean utf-8\?"):
        read_examples(str(f), "utf9")
    assert "--data-encoding 'rot13' is not a text encoding" in train(capsys, tmp_path, "--data-encoding", "rot13")
    assert train(capsys, tmp_path, "--data", str(tmp_path), tripwire=False) == (
        f"error: --data {str(tmp_path)!r} is a directory without a saved dataset (dataset_info.json, state.json, "
        "dataset_dict.json) or parquet/arrow files; give a dataset directory, data files or a JSONL/CSV/text file")
    f.write_bytes(LATIN1)

    def refused(*args, **kwargs):  # root reads any file: this is what a user without the permission meets
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", refused)
    with pytest.raises(BigfitError, match="pairs.jsonl' cannot be read: Permission denied"):
        read_examples(str(f))


def test_a_data_file_mistake_through_bigfit_train_is_one_line(capsys, tmp_path):
    f = tmp_path / "pairs.jsonl"
    f.write_bytes(LATIN1)
    assert main(["train", "--data", str(f), "--output-dir", str(tmp_path / "out")]) == 2
    assert "pairs.jsonl' line 2: 0xe9 at byte offset 46" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["config", "deepspeed", "device_map"])
def test_settings_files_that_do_not_read_are_one_line(tmp_path, kind):
    """--config, --deepspeed-config and --device-map MAP.json: a directory, bytes that are not UTF-8, empty."""
    from bigfit.settings.deepspeed import load_deepspeed_config
    from bigfit.device_map.strategy import read_spec

    what, read = {"config": ("config file", load_config_file),
                  "deepspeed": ("DeepSpeed config", lambda p: load_deepspeed_config(p, 1)),
                  "device_map": ("--device-map", lambda p: read_spec(SimpleNamespace(device_map=p)))}[kind]
    f = tmp_path / "settings.json"
    for path, data, needle in ((tmp_path, None, " is a directory; give "),
                               (f, b'{"lr": "caf\xe9"}', " line 1: 0xe9 at byte offset 11 is not valid utf-8 (invalid "
                                                         "continuation byte); save it as UTF-8"),
                               (f, b" \n", " is empty; give ")):
        if data is not None:
            f.write_bytes(data)
        with pytest.raises(BigfitError) as e:
            read(str(path))
        assert str(e.value).startswith(f"{what} {str(path)!r}{needle}")


@pytest.mark.parametrize("ds,needle", [
    ({"gradient_clipping": float("nan")}, "gradient_clipping must be a number, got nan"),
    ({"fp16": {"enabled": True, "hysteresis": float("inf")}}, "fp16.hysteresis must be an integer, got inf"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": 5}}},
     "zero_optimization.offload_optimizer.nvme_path must be a directory path (a string), got 5"),
])
def test_deepspeed_values_are_typed(tmp_path, ds, needle):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(ds))  # NaN and Infinity: Python's json writes and reads them, as DeepSpeed's loader does
    with pytest.raises(BigfitError) as e:
        config_from_args(parse_args(["train", "--deepspeed-config", str(f)]))
    assert str(e.value) == needle


PLAN_CASES = [
    (["--gpus", "2x0GB"], "--gpus '2x0GB': a GPU of '0GB' holds nothing; give each GPU's memory, like 16GB"),
    (["--gpus", "2x1GB"], "--gpus '2x1GB': the plan keeps 1 GiB of every GPU for the CUDA context and allocator"),
    (["--gpus", "99999999999x16GB"], "--gpus '99999999999x16GB' describes 99999999999 GPUs in one node; at most "
                                     "1024 per node: give more nodes with --nodes"),
    (["--gpus", "8x16GB", "--nodes", "0"], "--nodes must be from 1 to 100000, got 0"),
    (["--gpus", "8x16GB", "--nodes", "1000000"], "--nodes must be from 1 to 100000, got 1000000"),
    (["--gpus", "8x16GB", "--cpu-ram", "0GB"], "--cpu-ram '0GB' holds nothing; give each node's host RAM"),
    (["--gpus", "8x16GB", "--pcie-gbps", "0"], "--pcie-gbps must be more than 0, got 0.0"),
    (["--gpus", "8x16GB", "--cpu-tflops", "-1"], "--cpu-tflops must be more than 0, got -1.0"),
    (["--gpus", "8xH100", "--gpu-mem-gbps", "0"], "--gpu-mem-gbps must be more than 0, got 0.0"),
    (["--gpus", "8xB100"], "--gpus '8xB100': 'B100' is neither a size (16GB) nor a GPU bigfit knows"),
    (["--gpus", "8x16GB", "--micro-batch-size", "0"], "--micro-batch-size must be more than 0, got 0"),
    (["--gpus", "8x16GB", "--target-len", "-1"], "--target-len must be 0 or more, got -1"),
    (["--gpus", "8x16GB", "--nvme-host-gb", "-1"], "--nvme-host-gb must be 0 or more, got -1.0"),
]


@pytest.mark.parametrize("argv,needle", PLAN_CASES, ids=[" ".join(c[0][-2:]) for c in PLAN_CASES])
def test_plan_input_is_range_checked(capsys, argv, needle):
    assert main(["plan", *argv]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"error: {needle}")
