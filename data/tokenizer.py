"""Text to token ids: the byte-level tokenizer, a trained one from a `tokenizer.json`, or any
tokenizer `transformers`' `AutoTokenizer` loads (a hub name such as ``gpt2``, or a folder it saved).

Every tokenizer has an end-of-document id (`eos_id`) inside its `vocab_size`, so a model sized
by `vocab_size` can embed every id a token store holds, and a content `fingerprint()`: a sha256
over what maps text to ids, never the path or name it was loaded from, so that peers can check
that they tokenize alike (two folders of the same name holding different files differ; the
same files under two paths agree). The same tokenizer named two ways (a hub name, and the
`tokenizer.json` file of its folder) is read by two different classes and has two different
fingerprints: name it the same way on every peer.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from .base import INSTALL_HINT, DataError, _one_line_cause

HF_INSTALL_HINT = "install it with `pip install 'starling[hf]'`"
TRANSFORMERS_CONFIG = "tokenizer_config.json"  # a folder holding it was saved by transformers
# Keys of a saved tokenizer's config about where it was loaded from, not what it does.
PATH_KEYS = frozenset({"name_or_path", "_name_or_path", "tokenizer_file", "vocab_file", "merges_file"})

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
            raise DataError(f"{given}: a folder without a tokenizer.json (nor a {TRANSFORMERS_CONFIG} "
                            "for transformers)")
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


def _sha256_canonical(value: Any) -> str:
    """sha256 of `value` (plain JSON data) written one way: sorted keys, no spaces."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _saved_content(tokenizer: Any) -> dict[str, Any]:
    """What `tokenizer.save_pretrained` writes, file by file: JSON files parsed (so that key
    order and spacing do not count), any other file's sha256."""
    content: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="starling-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        for path in sorted(Path(folder).rglob("*")):
            if not path.is_file():
                continue
            raw = path.read_bytes()
            relative = path.relative_to(folder).as_posix()
            try:
                parsed = json.loads(raw) if path.suffix == ".json" else None
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):  # a config: its keys about where files were do not count
                content[relative] = {key: value for key, value in parsed.items() if key not in PATH_KEYS}
            else:
                content[relative] = hashlib.sha256(raw).hexdigest()
    return content


class HFTokenizer(Tokenizer):
    """A tokenizer that `transformers`' `AutoTokenizer` loads: a folder it saved (read with
    `local_files_only`: no network), or a name on the Hugging Face Hub (through transformers'
    cache: downloaded on first use, then read from the cache; ``HF_HUB_OFFLINE=1`` forbids the
    download). Code that is not part of `transformers` (``trust_remote_code``) is not run.

    End-of-document is the tokenizer's own `eos_token` when it has one, else the first of
    `EOS_CANDIDATES` it holds, else one id past its vocabulary (as `FileTokenizer` adds one).
    The fingerprint is a sha256 over the tokenizer's pipeline as the `tokenizers` library
    serializes it (vocabulary, merges, normalizer, pre-tokenizer, added tokens), or over the
    files `save_pretrained` writes for a tokenizer without one, with its class, `eos_id` and
    `vocab_size`.
    """

    def __init__(self, spec: str) -> None:
        try:
            import transformers
        except ImportError:
            raise DataError(f"tokenizer {spec}: loading a tokenizer by name needs Hugging Face `transformers`: "
                            f"{HF_INSTALL_HINT} (or name a tokenizer.json)") from None
        folder = Path(spec).expanduser()
        local = folder.is_dir()
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(folder) if local else spec, local_files_only=local, trust_remote_code=False
            )
        except Exception as exc:  # transformers raises OSError, ValueError and more; one failure to the user
            raise DataError(f"tokenizer {spec}: transformers cannot load it: {_one_line_cause(exc)}") from None
        self._tokenizer: Any = tokenizer
        self.name = spec
        size = len(tokenizer)
        eos = tokenizer.eos_token_id
        if eos is None:
            vocab = tokenizer.get_vocab()
            eos = next((vocab[token] for token in EOS_CANDIDATES if token in vocab), None)
        self._eos_added = eos is None
        self.eos_id = size if eos is None else int(eos)
        self.vocab_size = size + 1 if eos is None else max(size, self.eos_id + 1)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        pipeline = json.loads(backend.to_str()) if backend is not None else _saved_content(tokenizer)
        self._fingerprint = _sha256_canonical({"transformers": type(tokenizer).__name__, "pipeline": pipeline,
                                               "eos_id": self.eos_id, "vocab_size": self.vocab_size})

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        encoded = self._tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
        return [list(ids) for ids in encoded["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        if self._eos_added:
            ids = [token_id for token_id in ids if token_id != self.eos_id]
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def fingerprint(self) -> str:
        return self._fingerprint


def _looks_like_path(spec: str) -> bool:
    """A spec meant as a file or folder, not a hub name (`name` or `owner/name`)."""
    return (
        spec.startswith((".", "~", "/"))
        or (os.sep != "/" and os.sep in spec)
        or spec.count("/") > 1
        or Path(spec).suffix.lower() == ".json"
    )


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `spec` names: `""` or `"bytes"` for `ByteTokenizer`; a `tokenizer.json`
    file, or a folder holding one and no `tokenizer_config.json` (`FileTokenizer`); a folder
    that `transformers` saved (it holds a `tokenizer_config.json`), or a name on the Hugging
    Face Hub such as ``gpt2`` or ``owner/name`` (`HFTokenizer`). A path that does not exist is
    an error, never a hub name."""
    if spec in ("", "bytes"):
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / TRANSFORMERS_CONFIG).is_file():
        return HFTokenizer(spec)
    if path.exists() or _looks_like_path(spec):
        return FileTokenizer(spec)
    return HFTokenizer(spec)
