"""What every source shares: `DataError`, the `Source` interface, and small helpers for listing
files and loading Hugging Face `datasets`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

INSTALL_HINT = "install it with `pip install 'starling[data]'`"

DOCUMENT = "document"  # partition by: every document its own label


class DataError(ValueError):
    """A source, file or tokenizer that cannot be read. The message names the file, path or
    name at fault and what was wrong with it."""


class Source(ABC):
    """A corpus: a name and its documents in one fixed order."""

    name: str

    @abstractmethod
    def documents(self) -> Iterator[str]:
        """Every document's text, in the same order on every machine that holds the same files."""

    @abstractmethod
    def fingerprint(self) -> str:
        """A hex string that changes when the content changes."""

    def labels(self, by: str) -> np.ndarray:
        """Each document's label (int64 codes, in document order) for a non-IID partition of the
        corpus: `by` is ``document`` (every document its own label) or a kind this source knows
        (a table's column, a folder's subfolder). DataError naming what it can do otherwise."""
        if by == DOCUMENT:
            return np.arange(sum(1 for _ in self.documents()), dtype=np.int64)
        raise DataError(f"{self.name}: documents have no {by!r} to partition by; use {DOCUMENT!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _codes(values: Sequence[str]) -> np.ndarray:
    """Each value's index among the sorted distinct values (int64): the same labels on every
    machine, whatever order the values first appear in."""
    _, codes = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
    return codes.astype(np.int64).reshape(-1)


def _regular_files(folder: Path, *, recursive: bool) -> list[tuple[str, Path]]:
    """The regular files under `folder` as (relative posix path, path), sorted by the former."""
    candidates = folder.rglob("*") if recursive else folder.iterdir()
    files = [(path.relative_to(folder).as_posix(), path) for path in candidates if path.is_file()]
    files.sort(key=lambda entry: entry[0])
    return files


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading this data needs Hugging Face `datasets`: {INSTALL_HINT}") from None
    # A progress bar per file and INFO lines on every load drown the trainer's own log.
    datasets.disable_progress_bar()
    datasets.logging.set_verbosity_warning()
    return datasets


def _one_line_cause(exc: BaseException) -> str:
    """The most specific cause of a `datasets` failure, on one line: its own wrapper
    ("An error occurred while generating the dataset") says nothing about what broke."""
    cause: BaseException = exc
    while type(cause).__name__ == "DatasetGenerationError" and (cause.__cause__ or cause.__context__):
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    text = " ".join(str(cause).split()) or "no message"
    return f"{type(cause).__name__}: {text}"


def _has_glob(spec: str) -> bool:
    return any(char in spec for char in "*?[")
