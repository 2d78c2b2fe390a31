"""Token stores: tokenized once, cached by content, read as shifted rows."""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from starling.data.sources import DataError, Source, TextFolderSource
from starling.data.tokenizer import ByteTokenizer, Tokenizer
from starling.data.tokens import TokenStore, token_dtype


class ListSource(Source):
    """Documents from a list, counting how often they are read."""

    def __init__(self, texts: list[str], name: str = "list") -> None:
        self.name = name
        self.texts = texts
        self.reads = 0

    def documents(self) -> Iterator[str]:
        self.reads += 1
        yield from self.texts

    def fingerprint(self) -> str:
        return hashlib.sha256("\0".join(self.texts).encode()).hexdigest()


class WideTokenizer(Tokenizer):
    """Ids past 65535: each character's code point plus 70000."""

    name = "wide"
    vocab_size = 70000 + 0x110000 + 1
    eos_id = 70000 + 0x110000

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[70000 + ord(char) for char in text] for text in texts]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(token_id - 70000) for token_id in ids if token_id != self.eos_id)

    def fingerprint(self) -> str:
        return "wide"


def test_build_concatenates_documents_with_eos_and_caches(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = ListSource(["ab", "", "héllo"])
    tokenizer = ByteTokenizer()
    with caplog.at_level(logging.INFO, logger="starling.data.tokens"):
        store = TokenStore.build(source, tokenizer, tmp_path / "cache", batch_documents=2)
    expected = [97, 98, 256, 256, *"héllo".encode(), 256]
    assert store.tokens.tolist() == expected and len(store) == len(expected)
    assert store.tokens.dtype == np.uint16 and not store.tokens.flags.writeable
    assert (store.info.documents, store.info.source, store.info.tokenizer) == (3, "list", "bytes")
    assert store.vocab_size == 257
    assert "3 documents, 11 tokens" in caplog.text
    assert source.reads == 1

    again = TokenStore.build(source, tokenizer, tmp_path / "cache")
    assert source.reads == 1  # opened from the file, not tokenized again
    assert again.path == store.path and again.tokens.tolist() == expected
    reopened = TokenStore.open(store.path)
    assert reopened.info == store.info
    # Only the data file and its description are left: no temporary files.
    assert sorted(path.suffix for path in (tmp_path / "cache").iterdir()) == [".bin", ".json"]


def test_changed_content_builds_a_new_store(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("first")
    first = TokenStore.build(TextFolderSource(folder), ByteTokenizer(), tmp_path / "cache")
    (folder / "a.txt").write_text("second version")
    second = TokenStore.build(TextFolderSource(folder), ByteTokenizer(), tmp_path / "cache")
    assert second.path != first.path
    assert ByteTokenizer().decode(second.tokens.tolist()) == "second version"


def test_rows_and_batches_are_shifted_windows(tmp_path: Path) -> None:
    store = TokenStore.build(ListSource(["abcdefghij"]), ByteTokenizer(), tmp_path)
    tokens = store.tokens.tolist()  # 11 tokens: 10 bytes and EOS
    assert store.rows(3) == 3 and store.rows(10) == 1 and store.rows(11) == 0
    inputs, targets = store.batch([2, 0], seq_len=3)
    assert inputs.dtype == torch.int64 and targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (2, 3)
    assert inputs.tolist() == [tokens[6:9], tokens[0:3]]
    assert targets.tolist() == [tokens[7:10], tokens[1:4]]
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    inputs, targets = store.batch([], seq_len=3)
    assert inputs.shape == (0, 3)


def test_a_row_out_of_range_is_named(tmp_path: Path) -> None:
    store = TokenStore.build(ListSource(["abcdefghij"]), ByteTokenizer(), tmp_path)
    with pytest.raises(IndexError, match="row 3 is out of range: the store has 3 rows"):
        store.batch([0, 3], seq_len=3)
    with pytest.raises(IndexError, match="row -1"):
        store.batch([-1], seq_len=3)


def test_dtype_follows_the_vocabulary(tmp_path: Path) -> None:
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"
    store = TokenStore.build(ListSource(["hé"]), WideTokenizer(), tmp_path)
    assert store.tokens.dtype == np.uint32
    assert store.tokens.tolist() == [70000 + ord("h"), 70000 + ord("é"), WideTokenizer.eos_id]


def test_a_source_without_tokens_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="empty: no tokens"):
        TokenStore.build(ListSource([], name="empty"), ByteTokenizer(), tmp_path)
    with pytest.raises(DataError, match="blank: no tokens"):
        TokenStore.build(ListSource(["", ""], name="blank"), ByteTokenizer(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_source_leaves_nothing_under_the_final_name(tmp_path: Path) -> None:
    class Broken(ListSource):
        def documents(self) -> Iterator[str]:
            yield "fine"
            raise DataError("broken.txt: not UTF-8 text")

    with pytest.raises(DataError, match="broken.txt"):
        TokenStore.build(Broken(["x"]), ByteTokenizer(), tmp_path, batch_documents=1)
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    store = TokenStore.build(ListSource(["abcdef"]), ByteTokenizer(), tmp_path)
    path = store.path
    del store
    with open(path, "r+b") as file:
        file.truncate(4)
    with pytest.raises(DataError, match="4 bytes"):
        TokenStore.open(path)
