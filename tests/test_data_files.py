"""--data beyond JSONL/CSV/text: saved datasets, parquet and arrow files, hub names from the local
cache, the column mapping (the seed discussion's nested wmt_en_ro records) and prompt/completion;
each mistake one line. The `datasets` library is the `bigfit[data]` extra (installed for the tests)."""
from __future__ import annotations

import json
import sys

import pytest

from bigfit.data import read_examples
from bigfit.errors import BigfitError
from conftest import read_jsonl

datasets = pytest.importorskip("datasets")

WMT = [{"translation": {"en": f"{i} apples", "ro": f"{i} mere"}} for i in range(40)]
PAIRS = [{"source": f"{i} apples", "target": f"{i} mere"} for i in range(40)]
EN_RO = "source=translation.en,target=translation.ro"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_nested_records_are_read_through_the_column_mapping(tmp_path):
    data = _jsonl(tmp_path / "wmt_en_ro.jsonl", WMT)
    assert read_examples(data, columns=EN_RO) == PAIRS
    with pytest.raises(BigfitError, match=r"line 1: --data-columns names 'translation.de', but translation has no "
                                          r"'de' \(it has \['en', 'ro'\]\)"):
        read_examples(data, columns="source=translation.en,target=translation.de")
    with pytest.raises(BigfitError, match="each record needs 'source' and 'target' strings"):
        read_examples(data)  # without the mapping: what a record may hold, and the flag that maps it


def test_prompt_completion_records_are_pairs_and_text_can_be_any_column(tmp_path):
    prompts = [{"prompt": p["source"], "completion": p["target"]} for p in PAIRS]
    assert read_examples(_jsonl(tmp_path / "pc.jsonl", prompts)) == PAIRS
    assert read_examples(_jsonl(tmp_path / "t.jsonl", [{"content": "hello"}]), columns="text=content") == [{"text": "hello"}]
    (tmp_path / "c.csv").write_text("en,ro\nhello,salut\n")
    assert read_examples(str(tmp_path / "c.csv"), columns="source=en,target=ro") == [{"source": "hello", "target": "salut"}]


@pytest.mark.parametrize("spec,needle", [("source=en", "give both source and target, or text or messages alone"),
                                         ("input=en,target=ro", "'input=en' is not FIELD=COLUMN"),
                                         ("source=en,source=de", "names source twice"),
                                         ("text=a,source=b,target=c", "give both source and target, or text or messages alone")])
def test_a_bad_column_mapping_is_one_line_before_any_work(model_dirs, pairs_file, tmp_path, capsys, spec, needle):
    from bigfit.cli import main

    out = tmp_path / "out"
    assert main(["train", "--model", str(model_dirs["t5"]), "--data", str(pairs_file), "--data-columns", spec,
                 "--output-dir", str(out)]) == 2
    assert needle in capsys.readouterr().err and not out.exists()


def test_saved_datasets_parquet_and_arrow_files(tmp_path):
    table = datasets.Dataset.from_list(WMT)
    table.save_to_disk(str(tmp_path / "saved"))
    assert read_examples(str(tmp_path / "saved"), columns=EN_RO) == PAIRS
    datasets.DatasetDict(train=table, validation=table.select(range(3))).save_to_disk(str(tmp_path / "dict"))
    assert read_examples(str(tmp_path / "dict"), columns=EN_RO, split="validation") == PAIRS[:3]
    with pytest.raises(BigfitError, match=r"--data-split 'test': --data .* has the splits \['train', 'validation'\]"):
        read_examples(str(tmp_path / "dict"), columns=EN_RO, split="test")
    (tmp_path / "pq").mkdir()
    table.select(range(20)).to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    table.select(range(20, 40)).to_parquet(str(tmp_path / "pq" / "part-1.parquet"))
    assert read_examples(str(tmp_path / "pq"), columns=EN_RO) == PAIRS  # a directory of files, in name order
    assert read_examples(str(tmp_path / "pq" / "part-1.parquet"), columns=EN_RO) == PAIRS[20:]
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert read_examples(str(arrow), columns=EN_RO) == PAIRS
    with pytest.raises(BigfitError, match=r"has the columns \['translation'\], none of"):
        read_examples(str(tmp_path / "pq"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BigfitError, match="is a directory without a saved dataset"):
        read_examples(str(tmp_path / "empty"))


def test_a_hub_name_reads_the_local_cache_and_says_how_to_fetch_one_it_lacks(tmp_path, monkeypatch):
    # as a user who loaded the dataset before has it: prepared in datasets' cache under its name
    (tmp_path / "wmt_en_ro_tiny" / "data").mkdir(parents=True)
    datasets.Dataset.from_list(WMT).to_parquet(str(tmp_path / "wmt_en_ro_tiny" / "data" / "train-0.parquet"))
    datasets.load_dataset(str(tmp_path / "wmt_en_ro_tiny"), split="train")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the name is no path here: the tests run offline (conftest)
    assert read_examples("wmt_en_ro_tiny", columns=EN_RO) == PAIRS
    with pytest.raises(BigfitError, match="no dataset the local cache .* holds or the hub gave .*import datasets; "
                                          "datasets.load_dataset\\('nobody/none', 'ro-en'\\)"):
        read_examples("nobody/none", config="ro-en")


def test_without_the_datasets_library_a_table_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(BigfitError, match=r"read with the datasets library, which is not installed; pip install 'bigfit\[data\]'"):
        read_examples(str(tmp_path / "d.parquet"))


def test_train_on_a_parquet_directory_with_a_mapping_and_resume_refuses_another(model_dirs, tmp_path, capsys):
    from bigfit.cli import main

    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_list(WMT * 5).to_parquet(str(tmp_path / "pq" / "train.parquet"))
    out = tmp_path / "out"
    args = ["train", "--model", str(model_dirs["t5"]), "--data", str(tmp_path / "pq"), "--data-columns", EN_RO,
            "--strategy", "single", "--batch-size", "4", "--max-steps", "2", "--save-every", "2", "--eval-samples", "0",
            "--no-consolidate", "--output-dir", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    assert "200 train / 0 eval samples" in " ".join(capsys.readouterr().out.split())
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    resumed = [*args[:-2], "--max-steps", "4", "--resume", "--data-columns", "source=translation.ro,target=translation.en",
               "--output-dir", str(out)]
    assert main(resumed) == 2
    assert "data_columns" in capsys.readouterr().err
