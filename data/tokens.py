"""A corpus tokenized once into a memory-mapped file, read as fixed-length rows.

`TokenStore.build(source, tokenizer, cache_dir)` writes every document's ids followed by the
end-of-document id, concatenated, to one flat file named after the source's and the tokenizer's
fingerprints; a later build with the same content opens that file instead of tokenizing again.
Training reads rows of `seq_len + 1` consecutive tokens with stride `seq_len`: row `i` covers
`tokens[i * seq_len : i * seq_len + seq_len + 1]`, its first `seq_len` tokens are the inputs and
its last `seq_len` the targets (the inputs shifted by one).

The file is written to a temporary name in the same folder and renamed into place when
complete, so processes that build the same store at once are safe (the last rename wins, with
identical bytes) and a crash leaves no half-written file under the final name.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .sources import DataError, Source
from .streaming import StreamSource
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DTYPES: dict[str, type[np.unsignedinteger[Any]]] = {"uint16": np.uint16, "uint32": np.uint32}


def token_dtype(vocab_size: int) -> str:
    """The narrowest stored dtype for ids in `[0, vocab_size)`: half the disk and page cache of
    uint32 for any vocabulary up to 65536."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class TokenStoreInfo:
    """What a store holds, kept in the JSON file beside its tokens."""

    tokens: int
    dtype: str
    vocab_size: int
    documents: int
    source: str
    tokenizer: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, *, where: Path) -> TokenStoreInfo:
        try:
            raw = json.loads(text)
            info = cls(**raw)
        except (ValueError, TypeError) as exc:
            raise DataError(f"{where}: not a token store description: {exc}") from None
        if info.dtype not in DTYPES or info.tokens < 1 or info.vocab_size < 1:
            raise DataError(f"{where}: not a token store description: {raw}")
        return info


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable; some file systems cannot open a folder, which is fine."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomically(final: Path, write: Any) -> None:
    """Call `write(file)` on a fresh temporary file beside `final`, fsync it, rename it onto
    `final`; on any failure the temporary file is removed and `final` is untouched."""
    fd, temporary = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, final)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _batches(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for document in documents:
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class TokenStore:
    """A source's tokens in a read-only memory-mapped file (see the module's description)."""

    def __init__(self, path: Path, info: TokenStoreInfo, tokens: np.memmap) -> None:
        self._path = path
        self.info = info
        self._tokens = tokens

    @staticmethod
    def info_path(path: Path) -> Path:
        """Where the description of the store at `path` lives."""
        return path.with_suffix(".json")

    @classmethod
    def build(
        cls,
        source: Source,
        tokenizer: Tokenizer,
        cache_dir: str | os.PathLike[str],
        *,
        batch_documents: int = 256,
    ) -> TokenStore:
        """The store of `source` under `tokenizer` in `cache_dir`: opened when a store of the
        same content exists there, otherwise tokenized now, `batch_documents` documents at a
        time (memory holds one batch, not the corpus)."""
        if batch_documents < 1:
            raise ValueError(f"batch_documents must be at least 1, got {batch_documents}")
        if isinstance(source, StreamSource):
            raise DataError(f"{source.name}: a streamed corpus is read a unit at a time "
                            "(StreamSource.unit_batch), never tokenized whole into a token file")
        dtype = token_dtype(tokenizer.vocab_size)
        key = hashlib.sha256(
            json.dumps([source.fingerprint(), tokenizer.fingerprint(), dtype]).encode()
        ).hexdigest()
        folder = Path(cache_dir).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"tokens-{key[:32]}.bin"
        if path.exists():
            logger.info("token store for %s with %s: %s (cached)", source.name, tokenizer.name, path)
            return cls.open(path)

        started = time.monotonic()
        counts = {"documents": 0, "tokens": 0, "text_tokens": 0}

        def write_tokens(file: Any) -> None:
            eos = np.array([tokenizer.eos_id], dtype=np.int64)
            for batch in _batches(source.documents(), batch_documents):
                pieces: list[np.ndarray] = []
                for ids in tokenizer.encode_batch(batch):
                    pieces.append(np.asarray(ids, dtype=np.int64))
                    pieces.append(eos)
                flat = np.concatenate(pieces)
                low, high = int(flat.min()), int(flat.max())
                if low < 0 or high >= tokenizer.vocab_size:
                    raise DataError(
                        f"tokenizer {tokenizer.name}: produced id {low if low < 0 else high} for {source.name}, "
                        f"outside its vocab_size {tokenizer.vocab_size}"
                    )
                file.write(flat.astype(DTYPES[dtype]).tobytes())
                counts["documents"] += len(batch)
                counts["tokens"] += flat.size
                counts["text_tokens"] += flat.size - len(batch)
            if counts["text_tokens"] == 0:
                raise DataError(f"{source.name}: no tokens ({counts['documents']} documents, all empty)")
            info = TokenStoreInfo(
                tokens=counts["tokens"],
                dtype=dtype,
                vocab_size=tokenizer.vocab_size,
                documents=counts["documents"],
                source=source.name,
                tokenizer=tokenizer.name,
            )
            # The description goes in first: whoever sees the tokens under their final name
            # finds it beside them.
            _write_atomically(cls.info_path(path), lambda info_file: info_file.write(info.to_json().encode()))

        _write_atomically(path, write_tokens)
        _fsync_dir(folder)
        logger.info(
            "tokenized %s with %s: %d documents, %d tokens in %.1f s -> %s",
            source.name,
            tokenizer.name,
            counts["documents"],
            counts["tokens"],
            time.monotonic() - started,
            path,
        )
        return cls.open(path)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenStore:
        """The store whose tokens are at `path` (its description beside it, `.json`)."""
        path = Path(path).expanduser()
        info_path = cls.info_path(path)
        try:
            info = TokenStoreInfo.from_json(info_path.read_text(), where=info_path)
            size = path.stat().st_size
        except OSError as exc:
            raise DataError(f"{exc.filename or path}: cannot read token store: {exc.strerror or exc}") from None
        dtype = DTYPES[info.dtype]
        expected = info.tokens * np.dtype(dtype).itemsize
        if size != expected:
            raise DataError(f"{path}: {size} bytes, but its description says {info.tokens} {info.dtype} tokens")
        tokens = np.memmap(path, dtype=dtype, mode="r", shape=(info.tokens,))
        return cls(path, info, tokens)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def tokens(self) -> np.memmap:
        """Every token, read-only, mapped from the file."""
        return self._tokens

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def __len__(self) -> int:
        return self.info.tokens

    def __repr__(self) -> str:
        return f"TokenStore({str(self._path)!r}, tokens={self.info.tokens}, source={self.info.source!r})"

    def document_ends(self, eos_id: int, chunk: int = 1 << 24) -> np.ndarray:
        """The position of each document's end token (int64, ascending), read `chunk` tokens
        at a time: token p belongs to document `searchsorted(ends, p)`."""
        found = [np.flatnonzero(self._tokens[lo:lo + chunk] == eos_id) + lo for lo in range(0, len(self), chunk)]
        return np.concatenate(found).astype(np.int64) if found else np.zeros(0, dtype=np.int64)

    def rows(self, seq_len: int) -> int:
        """How many rows of `seq_len + 1` tokens fit with stride `seq_len`."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        return (len(self) - 1) // seq_len

    def batch(self, rows: Sequence[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of `rows`, int64 tensors of shape `(len(rows), seq_len)`."""
        count = self.rows(seq_len)
        index = np.asarray(rows, dtype=np.int64).reshape(-1)
        outside = index[(index < 0) | (index >= count)]
        if outside.size:
            raise IndexError(f"row {int(outside[0])} is out of range: the store has {count} rows of seq_len {seq_len}")
        positions = index[:, None] * seq_len + np.arange(seq_len + 1, dtype=np.int64)
        window = self._tokens[positions].astype(np.int64)
        inputs = torch.from_numpy(np.ascontiguousarray(window[:, :-1]))
        targets = torch.from_numpy(np.ascontiguousarray(window[:, 1:]))
        return inputs, targets
