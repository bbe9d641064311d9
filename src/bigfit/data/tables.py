"""--data as the Hugging Face datasets library reads it (the `bigfit[data]` extra):
- a directory `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote (load_from_disk; a
  DatasetDict's split by --data-split);
- parquet or arrow files, or a directory holding them (all of one kind, in name order);
- a dataset name on the hub (`wmt16`, `owner/name`) with --data-config and --data-split, from the
  local cache or downloaded (HF_HUB_OFFLINE=1: the cache alone); one that is neither gets one line
  saying how to fetch it.
Records come out as dicts (nested columns as nested dicts) for columns.Columns to read.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from ..errors import BigfitError

TABLE_SUFFIXES = (".parquet", ".arrow")
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
EXTRA = "pip install 'bigfit[data]'"


def is_table(path: str) -> bool:
    """Whether --data names something only the datasets library reads (not JSONL, CSV or text)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return True
    if p.exists():
        return p.suffix in TABLE_SUFFIXES
    return looks_like_hub_name(path)


def looks_like_hub_name(path: str) -> bool:
    """`name` or `owner/name`, without a file suffix or a path's leading ./, ~ or /."""
    parts = path.split("/")
    return (len(parts) <= 2 and all(parts) and not path.startswith((".", "~"))
            and Path(parts[-1]).suffix not in (".jsonl", ".json", ".csv", ".txt", *TABLE_SUFFIXES))


def read_table(path: str, split: str, config: str | None):
    """The datasets.Dataset --data names (module docstring), or one line saying why not."""
    try:
        import datasets
    except ImportError:
        raise BigfitError(f"--data {path!r} is read with the datasets library, which is not installed; {EXTRA}") from None
    p = Path(path).expanduser()
    with _quiet(datasets):
        if p.is_dir() and any((p / m).exists() for m in SAVED_MARKERS):
            return _split_of(datasets.load_from_disk(str(p)), path, split)
        if p.is_dir() or p.exists():
            files = _table_files(p, path)
            kind = "parquet" if files[0].suffix == ".parquet" else "arrow"
            return datasets.load_dataset(kind, data_files={"train": [str(f) for f in files]}, split="train")
        return _from_cache(datasets, path, split, config)


@contextlib.contextmanager
def _quiet(datasets):
    """datasets' own progress bars and notes ("using the latest cached version") off while reading, the
    run saying what it read; the caller's settings back after (a notebook's `bigfit.run` keeps its own)."""
    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _table_files(p: Path, path: str) -> list[Path]:
    if p.is_file():
        return [p]
    found = {s: sorted(f for f in p.rglob(f"*{s}") if f.is_file()) for s in TABLE_SUFFIXES}
    kinds = [s for s, files in found.items() if files]
    if not kinds:
        raise BigfitError(f"--data {path!r} is a directory without a saved dataset ({', '.join(SAVED_MARKERS)}) "
                          f"or parquet/arrow files; give a dataset directory, data files or a JSONL/CSV/text file")
    if len(kinds) > 1:
        raise BigfitError(f"--data {path!r} holds both parquet and arrow files; give a directory of one kind")
    return found[kinds[0]]


def _split_of(loaded, path: str, split: str):
    if not hasattr(loaded, "keys"):  # a Dataset: it is the split
        return loaded
    if split not in loaded:
        raise BigfitError(f"--data-split {split!r}: --data {path!r} has the splits {sorted(loaded)}")
    return loaded[split]


def _from_cache(datasets, name: str, split: str, config: str | None):
    """A hub dataset: from the local cache, or downloaded where the hub is reachable (the launcher
    reads it first, so its workers find it in the cache)."""
    try:
        return datasets.load_dataset(name, config, split=split)
    except ValueError as e:  # an unknown split or configuration: datasets names the valid ones
        raise BigfitError(f"--data {name!r}: {_first_line(e)}") from None
    except Exception as e:  # offline and not cached (ConnectionError), or no such dataset on the hub
        call = f"datasets.load_dataset({name!r}{', ' + repr(config) if config else ''})"
        raise BigfitError(
            f"--data {name!r} is no file or directory here, and no dataset the local cache "
            f"({datasets.config.HF_DATASETS_CACHE}) holds or the hub gave ({type(e).__name__}: {_first_line(e)}); "
            f"run `python -c \"import datasets; {call}\"` where the hub is reachable, or give a path") from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
