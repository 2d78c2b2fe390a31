"""Text to token ids: the byte-level tokenizer, or a trained one from a `tokenizer.json`.

Every tokenizer has an end-of-document id (`eos_id`) inside its `vocab_size`, so a model sized
by `vocab_size` can embed every id a token store holds.
"""
from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from .sources import INSTALL_HINT, DataError

# Tried in this order; the first one the vocabulary holds ends each document.
EOS_CANDIDATES: tuple[str, ...] = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


class Tokenizer(ABC):
    """Turns text into ids in `[0, vocab_size)` and back. `eos_id` ends each document."""

    name: str
    vocab_size: int
    eos_id: int

    @abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, without any special token (the caller appends `eos_id`)."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """The text of `ids` (for reading samples; it need not be the exact inverse)."""

    @abstractmethod
    def fingerprint(self) -> str:
        """A hex string that changes when the mapping from text to ids does."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text, ids 0..255, and 256 for end-of-document: no training, no
    unknown characters, any language."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).tolist() for text in texts]

    def decode(self, ids: list[int]) -> str:
        """The text of the bytes in `ids`; end-of-document ids are left out and a byte sequence
        cut inside a character shows as U+FFFD."""
        array = np.asarray(ids, dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() > self.eos_id):
            raise ValueError(f"byte tokenizer ids are 0..{self.eos_id}, got {array.min()}..{array.max()}")
        return array[array != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return hashlib.sha256(b"starling byte tokenizer: utf-8 bytes, eos 256").hexdigest()


class FileTokenizer(Tokenizer):
    """A trained tokenizer (BPE, WordPiece, Unigram) from a Hugging Face `tokenizer.json`, run
    by the `tokenizers` library.

    End-of-document is the first of `EOS_CANDIDATES` that the vocabulary holds; when it holds
    none, one id past the vocabulary is added for it (so `vocab_size` is one more than the
    file's).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        given = Path(path).expanduser()
        file = given / "tokenizer.json" if given.is_dir() else given
        if given.is_dir() and not file.is_file():
            raise DataError(f"{given}: a folder without a tokenizer.json")
        if not file.is_file():
            raise DataError(f"{given}: no such tokenizer file")
        try:
            import tokenizers
        except ImportError:
            raise DataError(f"{file}: reading it needs Hugging Face `tokenizers`: {INSTALL_HINT}") from None
        try:
            self._raw = file.read_bytes()
            self._tokenizer: Any = tokenizers.Tokenizer.from_str(self._raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
            cause = " ".join(str(exc).split()) or type(exc).__name__
            raise DataError(f"{file}: not a tokenizer file `tokenizers` can read: {cause}") from None
        self.name = str(path)
        self.path = file
        size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        found = [self._tokenizer.token_to_id(token) for token in EOS_CANDIDATES]
        eos = next((token_id for token_id in found if token_id is not None), None)
        self._eos_added = eos is None
        self.eos_id = size if eos is None else int(eos)
        self.vocab_size = size + 1 if eos is None else max(size, self.eos_id + 1)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        if self._eos_added:
            # The added end-of-document id is ours, not the file's: `tokenizers` knows no text for it.
            ids = [token_id for token_id in ids if token_id != self.eos_id]
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def fingerprint(self) -> str:
        return hashlib.sha256(self._raw).hexdigest()


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `spec` names: `""` or `"bytes"` for `ByteTokenizer`, otherwise a
    `tokenizer.json` file or a folder holding one (`FileTokenizer`)."""
    if spec in ("", "bytes"):
        return ByteTokenizer()
    return FileTokenizer(spec)
