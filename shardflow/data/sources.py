"""Where a dataset's rows come from: a JSONL or Parquet file, a Hugging Face dataset directory
(written by ``save_to_disk``, or data files named by split as on the Hub), or a Hugging Face
dataset by name, read from the local cache unless downloads are allowed.

``dataset_rows`` gives ``(where, row)`` pairs, ``where`` naming the row in errors: JSONL lines
are counted from 1 as editors do, Parquet and dataset rows from 0 as dataframes do. A split or a
column that does not exist is named with the ones that do, before any row is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Source:
    """A dataset as the settings name it; ``key`` is the settings section (``data``, ``eval``)."""

    key: str
    path: str = ""
    dataset: str = ""
    dataset_config: str = ""
    split: str = "train"
    allow_download: bool = False

    @property
    def name(self) -> str:
        """How errors name it."""
        if self.path and Path(self.path).is_file():
            return self.path
        return f"{self.path or self.dataset} (split {self.split})"


def source_of(settings: Any, key: str, *, allow_download: bool = False) -> Source:
    """The ``Source`` of a ``DataConfig`` or ``EvalConfig``."""
    return Source(key, settings.path, settings.dataset, settings.dataset_config, settings.split,
                  getattr(settings, "allow_download", allow_download))


def check_source(source: Source) -> None:
    """That a source names exactly one dataset that exists (files are opened later)."""
    if bool(source.path) == bool(source.dataset):
        raise ValueError(f"{source.key}.path or {source.key}.dataset must be set (one of them, not both)")
    if source.dataset:
        return
    path = Path(source.path)
    if not path.exists():
        raise FileNotFoundError(f"{source.key}.path {path} does not exist")
    if path.is_file() and path.suffix.lower() not in FILE_SUFFIXES:
        raise ValueError(f"{source.key}.path must be a .jsonl or .parquet file or a dataset directory, "
                         f"got {path.name}")


def dataset_rows(source: Source, *, columns: tuple[str, ...] = (), any_of: tuple[str, ...] = ()
                 ) -> Iterator[tuple[str, Any]]:
    """(where, row) for each row. For a Hugging Face dataset, ``columns`` must all be columns of
    it and at least one of ``any_of`` (each given as (settings key, column) pairs' column names)."""
    check_source(source)
    path = Path(source.path) if source.path else None
    if path is not None and path.is_file():
        yield from _file_rows(path)
        return
    table = _hf_split(source)
    names = list(table.column_names)
    for column in columns:
        if column not in names:
            raise ValueError(f"{source.name} has no column {column!r} (columns: {', '.join(names)}); set the "
                             f"{source.key} column keys (data.prompt_key, data.answer_key, ...)")
    if any_of and not any(c in names for c in any_of):
        raise ValueError(f"{source.name} has none of the columns {', '.join(map(repr, any_of))} (columns: "
                         f"{', '.join(names)}); set data.prompt_key or data.messages_key")
    for number, row in enumerate(table):
        yield f"{source.name} row {number}", row


def _file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        for number, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {number}", row
        return
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path} line {number}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not valid JSON: {e.msg} (column {e.colno})") from None


def _hf_split(source: Source):
    """The split of a Hugging Face dataset (a directory or a name), as a ``datasets.Dataset``."""
    try:
        import datasets
    except ImportError:
        what = f"{source.key}.dataset" if source.dataset else f"{source.key}.path (a directory)"
        raise ValueError(f"{what} needs the datasets package: pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    config = source.dataset_config or None
    if source.path:
        path = Path(source.path)
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.Dataset):  # one split saved alone: the split setting names nothing
                return loaded
        else:
            loaded = _load(datasets, str(path), config, source)
    else:
        loaded = _load(datasets, _cached_snapshot(source) or source.dataset, config, source)
    splits = list(loaded)
    if source.split not in splits:
        raise ValueError(f"{source.key}.split {source.split!r} is not a split of {source.path or source.dataset} "
                         f"(splits: {', '.join(splits)})")
    return loaded[source.split]


def _load(datasets, where: str, config: str | None, source: Source):
    try:
        return datasets.load_dataset(where, name=config)
    except ValueError as e:  # a configuration that does not exist, among others
        raise ValueError(f"{source.key}: cannot load {source.path or source.dataset}: {e}") from None
    except (ConnectionError, OSError) as e:
        raise ValueError(f"{source.key}.dataset {source.dataset!r} cannot be loaded: {e}") from None


def _cached_snapshot(source: Source) -> str | None:
    """The local copy of a Hub dataset in the Hugging Face cache; without one, an error unless
    downloads are allowed (then None: ``datasets`` downloads it)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(source.dataset, repo_type="dataset", local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache, whatever the hub library calls it
        if source.allow_download:
            return None
    raise ValueError(f"{source.key}.dataset {source.dataset!r} is not in the local Hugging Face cache; download it "
                     f"once (hf download --repo-type dataset {source.dataset}) or set data.allow_download=true")
