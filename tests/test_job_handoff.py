"""The resolved job is made once, by the job's starter: its workers read OUTPUT/job.json and map the
tokenized data it left them, parsing no argv, validating, resolving and tokenizing nothing."""
import json
import os
import subprocess
import sys
import textwrap

from conftest import read_jsonl

# Counts the calls of the functions a worker must not make, in every process of the job (the
# launcher too), each process's counts written at its exit under COUNTS/<rank or launcher>.json.
# Patched before the modules that import these names by value are imported.
COUNTER = textwrap.dedent('''
    import atexit, collections, json, os
    counts = collections.Counter()

    def counted(module, name):
        real = getattr(module, name)
        def wrapper(*a, **k):
            counts[name] += 1
            return real(*a, **k)
        setattr(module, name, wrapper)

    import bigfit.job.checks, bigfit.job.resolution
    counted(bigfit.job.checks, "validate")
    counted(bigfit.job.resolution, "resolve")
    import bigfit.cli, bigfit.job.prepare
    counted(bigfit.cli, "parse_args")
    counted(bigfit.job.prepare, "_read_dataset")

    @atexit.register
    def _write():
        who = os.environ.get("RANK", "launcher")
        with open(os.path.join(os.environ["COUNTS"], who + ".json"), "w") as f:
            json.dump(dict(counts), f)
''')


def test_workers_run_the_job_their_launcher_resolved(model_dirs, pairs_file, tmp_path):
    shim, counts, out = tmp_path / "shim", tmp_path / "counts", tmp_path / "out"
    shim.mkdir()
    counts.mkdir()
    (shim / "sitecustomize.py").write_text(COUNTER)
    env = {**os.environ, "COUNTS": str(counts), "PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])}
    argv = ["train", "--model", model_dirs["gpt2"], "--data", pairs_file, "--nproc", "2", "--strategy", "zero2",
            "--batch-size", "4", "--max-steps", "2", "--eval-samples", "4", "--eval-every", "0", "--no-eval-on-start",
            "--no-checkpoints", "--output-dir", out]
    done = subprocess.run([sys.executable, "-m", "bigfit", *map(str, argv)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = {p.stem: json.loads(p.read_text()) for p in counts.glob("*.json")}
    assert set(calls) == {"launcher", "0", "1"}
    # the launcher: argv once, the settings validated once, the job resolved once, the data tokenized once
    assert calls["launcher"] == {"parse_args": 1, "validate": 1, "resolve": 1, "_read_dataset": 1}
    assert calls["0"] == calls["1"] == {}  # the workers: none of it
    job = json.loads((out / "job.json").read_text())
    assert job["plan"]["dp_shard"] == 2 and job["plan"]["zero"] == 2 and job["batching"]["per_rank"] == 2
    assert job["cfg"]["micro_batch_size"] == 2 and job["cfg"]["precision"] == "fp32"
    assert job["data"]["lengths"] and job["data"]["tokenized"]  # the mapped data's directory, gone with the job
    assert not os.path.exists(job["data"]["tokenized"])
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    # what train printed as its prediction is `bigfit plan`'s row for its strategy, given the same settings
    from bigfit import plan
    from bigfit.job.autoplan import row_text

    rows = plan(model=str(model_dirs["gpt2"]), data=str(pairs_file), nproc=2, strategy="zero2", batch_size=4,
                eval_samples=4)["strategies"]
    assert job["prediction"] == row_text(next(r for r in rows if r["name"] == "zero2"))
    assert "prediction" in done.stdout and job["prediction"].split(":")[0] == "zero2"


def test_handed_over_samples_are_the_tokenized_ones(model_dirs, pairs_file, tmp_path):
    from bigfit.settings.config import TrainConfig
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import handed_over, load, prepare

    cfg = TrainConfig(model=str(model_dirs["llama"]), data=str(pairs_file), strategy="zero2", batch_size=4,
                      eval_samples=8, pack=True, output_dir=str(tmp_path / "out"))
    ready = prepare(resolve(cfg, 2))
    mapped = load(handed_over(ready, tmp_path / "data"))
    assert len(mapped.dataset.train) == len(ready.dataset.train) and mapped.dataset.packed == ready.dataset.packed
    for i in (0, len(ready.dataset.train) // 2, len(ready.dataset.train) - 1):
        assert mapped.dataset.train[i] == {k: ready.dataset.train[i][k] for k in mapped.dataset.train[i]}
        assert set(mapped.dataset.train[i]) == {"input_ids", "labels", "parts"}
    assert mapped.dataset.eval == ready.dataset.eval and mapped.job.data == ready.job.data.__class__(
        str(tmp_path / "data"), ready.job.data.lengths, ready.job.data.sha256)
