"""Where the text comes from: a `Source` yields every document of a corpus, in one fixed order.

Four kinds of source, all behind one call, `open_source(spec)`:

- a folder of text files (`TextFolderSource`): one file, one document, read as strict UTF-8;
- JSON lines, CSV, Parquet or plain-text files, or a dataset on the Hugging Face Hub
  (`HFSource`): Hugging Face `datasets` reads them into memory-mapped Arrow tables, so a corpus
  larger than memory stays on disk; the text is one column of the table;
- the running Python's standard library (`stdlib_source`): a few megabytes of real text that
  ships with every Python and needs no download;
- ``stream:`` and a folder, glob, URL or Hub name (`starling.data.streaming.StreamSource`): shard
  files read a unit at a time, for a corpus larger than the disk; nothing is converted whole.

The order of the documents depends only on the files (never on the directory listing order of
the file system), so every machine that holds the same files reads the same documents in the
same order. `Source.fingerprint()` changes when the content does; a token cache keys on it.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .base import (
    DOCUMENT,
    DataError,
    Source,
    _codes,
    _has_glob,
    _import_datasets,
    _one_line_cause,
    _regular_files,
)

logger = logging.getLogger(__name__)


DEFAULT_TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".rst", ".py", ".text")

# Suffix -> the `datasets` builder that reads it.
HF_BUILDERS: dict[str, str] = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
# A folder holding only these is a table corpus (HFSource); any other folder is a text corpus.
TABLE_SUFFIXES = frozenset({".json", ".jsonl", ".csv", ".parquet"})

HF_BATCH_ROWS = 256

FOLDER = "folder"  # partition by: a text file's folder (relative to the corpus's)


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _files_fingerprint(files: Sequence[tuple[str, Path]]) -> str:
    """sha256 over relative paths, sizes and modification times: cheap, and any edit changes it."""
    entries = []
    for relative, path in files:
        try:
            stat = path.stat()
        except OSError as exc:
            raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
        entries.append([relative, stat.st_size, stat.st_mtime_ns])
    return _sha256_json(entries)


class TextFolderSource(Source):
    """Every regular file under a folder whose suffix is one of `suffixes`, one document per file.

    Files are taken in the order of their paths relative to the folder (posix form), so the
    order is the same on every machine. `suffixes=()` takes every file; `recursive=False` only
    the folder's own files. A file that is not valid UTF-8 is an error (naming the file and the
    byte offset), never silently altered text.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        suffixes: Sequence[str] = DEFAULT_TEXT_SUFFIXES,
        recursive: bool = True,
        name: str | None = None,
    ) -> None:
        self.folder = Path(folder).expanduser()
        self.suffixes = tuple(suffix.lower() for suffix in suffixes)
        self.recursive = recursive
        self.name = name if name is not None else str(folder)
        if not self.folder.is_dir():
            raise DataError(f"{self.folder}: not a folder")
        self._files()  # an empty corpus is an error now, not at the first batch

    def _files(self) -> list[tuple[str, Path]]:
        files = [
            (relative, path)
            for relative, path in _regular_files(self.folder, recursive=self.recursive)
            if not self.suffixes or path.suffix.lower() in self.suffixes
        ]
        if not files:
            wanted = " ".join(self.suffixes) if self.suffixes else "any suffix"
            where = "under" if self.recursive else "in"
            raise DataError(f"{self.folder}: no files {where} it with suffix {wanted}")
        return files

    def documents(self) -> Iterator[str]:
        for _, path in self._files():
            try:
                raw = path.read_bytes()
            except OSError as exc:
                raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: not UTF-8 text: {exc.reason} at byte offset {exc.start}") from None

    def fingerprint(self) -> str:
        return _files_fingerprint(self._files())

    def labels(self, by: str) -> np.ndarray:
        """``document``: each file its own label; ``folder``: the folder holding the file
        (relative to the corpus's; files at the top share one label)."""
        files = self._files()
        if by == DOCUMENT:
            return np.arange(len(files), dtype=np.int64)
        if by == FOLDER:
            return _codes([relative.rpartition("/")[0] for relative, _ in files])
        raise DataError(f"{self.name}: a folder of text files is partitioned by {DOCUMENT!r} or {FOLDER!r}, "
                        f"not {by!r}")


def stdlib_source() -> TextFolderSource:
    """The running Python's standard library: its top-level `*.py` files (a few megabytes of
    real text that ships with Python and needs no download)."""
    return TextFolderSource(sysconfig.get_paths()["stdlib"], suffixes=(".py",), recursive=False, name="stdlib")


def _local_files(spec: str) -> list[Path] | None:
    """The data files `spec` names (a file, a folder of them, a glob), or None when it names
    nothing on this machine."""
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [file for _, file in _regular_files(path, recursive=True) if file.suffix.lower() in HF_BUILDERS]
        where = "in this folder"
    elif _has_glob(spec):
        files = [Path(match) for match in sorted(glob.glob(os.path.expanduser(spec), recursive=True))]
        files = [file for file in files if file.is_file()]
        where = "match"
    else:
        return None
    if not files:
        raise DataError(f"{spec}: no data files {where} (supported suffixes: {' '.join(HF_BUILDERS)})")
    return files


class HFSource(Source):
    """Text from one column of a table read by Hugging Face `datasets`.

    `spec` is a local file (`.json`, `.jsonl`, `.csv`, `.parquet`, `.txt`), a folder of such
    files, a glob (`data/*.jsonl`), or else the name of a dataset on the Hugging Face Hub, read
    with `split`. A `.txt` file is one document. The text is the column `text_field`; a row
    whose value is missing (None) is an empty document. The table stays memory-mapped on disk
    (in `cache_dir`, or `datasets`' own cache) and is read in batches, so memory stays bounded
    whatever the corpus size.
    """

    def __init__(
        self,
        spec: str,
        *,
        text_field: str = "text",
        split: str = "train",
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.name = spec
        self.text_field = text_field
        self.split = split
        datasets = _import_datasets()
        files = _local_files(spec)
        builder = None if files is None else self._builder(spec, files)
        cache = None if cache_dir is None else str(cache_dir)
        try:
            if files is None:
                dataset = datasets.load_dataset(spec, split=split, cache_dir=cache)
            else:
                # One .txt file is one document, not one per line.
                options = {"sample_by": "document"} if builder == "text" else {}
                dataset = datasets.load_dataset(
                    builder, data_files=[str(file) for file in files], split=split, cache_dir=cache, **options
                )
        except Exception as exc:  # datasets raises many kinds; each is the same failure to the user
            raise DataError(f"{spec}: cannot load: {_one_line_cause(exc)}") from None
        if isinstance(dataset, datasets.IterableDataset) or not isinstance(dataset, datasets.Dataset):
            raise DataError(f"{spec}: expected one table for split {split!r}, got {type(dataset).__name__}")
        columns = list(dataset.column_names)
        if text_field not in columns:
            raise DataError(f"{spec}: no column {text_field!r}; its columns are {', '.join(columns) or 'none'}")
        feature = dataset.features[text_field]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise DataError(f"{spec}: column {text_field!r} holds {feature}, not text")
        self._table = dataset
        self._dataset = dataset.select_columns([text_field])

    @staticmethod
    def _builder(spec: str, files: Sequence[Path]) -> str:
        builders = {HF_BUILDERS.get(file.suffix.lower()) for file in files}
        if None in builders:
            unknown = next(file for file in files if file.suffix.lower() not in HF_BUILDERS)
            raise DataError(f"{unknown}: unsupported suffix; supported: {' '.join(HF_BUILDERS)}")
        if len(builders) > 1:
            raise DataError(f"{spec}: mixes formats ({', '.join(sorted(b for b in builders if b))}); use one")
        return builders.pop()  # type: ignore[return-value]

    def __len__(self) -> int:
        """The number of documents (rows)."""
        return len(self._dataset)

    def documents(self) -> Iterator[str]:
        for batch in self._dataset.iter(batch_size=HF_BATCH_ROWS):
            for text in batch[self.text_field]:
                yield "" if text is None else text

    def labels(self, by: str) -> np.ndarray:
        """``document``: each row its own label; else `by` names a column, whose distinct
        values are the labels (None is one more value)."""
        if by == DOCUMENT:
            return np.arange(len(self._dataset), dtype=np.int64)
        columns = [c for c in self._table.column_names if c != self.text_field]
        if by not in columns:
            raise DataError(f"{self.name}: no column {by!r} to partition by; its other columns are "
                            f"{', '.join(columns) or 'none'} (or {DOCUMENT!r})")
        values: list[str] = []
        for batch in self._table.select_columns([by]).iter(batch_size=HF_BATCH_ROWS * 16):
            values.extend(json.dumps(v, sort_keys=True, default=str) for v in batch[by])
        return _codes(values)

    def fingerprint(self) -> str:
        # datasets' fingerprint covers the files (it hashes their paths and modification times)
        # and how they were read; the spec and column pick what is taken from them.
        return _sha256_json([self._dataset._fingerprint, self.name, self.text_field, self.split])


def _looks_like_path(spec: str) -> bool:
    """A spec the user meant as a file or folder, not a Hub name. Hub names are `name` or
    `owner/name`, so one `/` alone does not make a path."""
    return (
        spec.startswith((".", "~", "/"))
        or (os.sep != "/" and os.sep in spec)
        or (os.altsep is not None and os.altsep != "/" and os.altsep in spec)
        or spec.count("/") > 1
        or Path(spec).suffix.lower() in HF_BUILDERS
    )


def open_source(
    spec: str,
    *,
    text_field: str = "text",
    split: str = "train",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Source:
    """The source `spec` names:

    - `""` or `"stdlib"`: the standard library's source (`stdlib_source`);
    - a folder: its text files (`TextFolderSource`), or, when it holds only `.json`, `.jsonl`,
      `.csv` and `.parquet` files, those tables (`HFSource`);
    - a file or a glob: read by its suffix (`HFSource`; a `.txt` file is one document);
    - a path that does not exist (it starts with `/`, `.` or `~`, or has a data file's
      suffix): an error;
    - anything else: a dataset on the Hugging Face Hub (`owner/name`), read with `split`;
    - ``stream:`` and any of those but `stdlib`: its shard files, read a unit at a time
      (`starling.data.streaming.StreamSource`, with its default `unit_bytes`).

    `text_field`, `split` and `cache_dir` apply to `HFSource`s; `text_field` and `split` to a
    `StreamSource`.
    """
    if spec in ("", "stdlib"):
        return stdlib_source()
    from .streaming import StreamSource, is_stream_spec

    if is_stream_spec(spec):
        return StreamSource(spec, text_field=text_field, split=split)
    path = Path(spec).expanduser()
    hf_options: dict[str, Any] = {"text_field": text_field, "split": split, "cache_dir": cache_dir}
    if path.is_dir():
        files = _regular_files(path, recursive=True)
        if files and all(file.suffix.lower() in TABLE_SUFFIXES for _, file in files):
            return HFSource(spec, **hf_options)
        return TextFolderSource(path, name=spec)
    if path.is_file() or _has_glob(spec):
        return HFSource(spec, **hf_options)
    if _looks_like_path(spec):
        raise DataError(f"no such file or folder: {spec}")
    return HFSource(spec, **hf_options)
