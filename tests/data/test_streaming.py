"""Streamed corpora: shard files read a unit at a time, every unit once an epoch, resumable, and
retried when a read fails."""
from __future__ import annotations

import io
import json
import logging
import random
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from starling.data import streaming
from starling.data.assignment import UnitLedger
from starling.data.sources import DataError, open_source
from starling.data.streaming import IGNORE_INDEX, StreamSource, hub_files, open_url, pack_rows
from starling.data.tokenizer import ByteTokenizer
from starling.data.tokens import TokenStore

WORDS = ["alpha", "beta", "gamma", "délta", "ε", "✓", "日本", "🙂", "x"]
BYTES = ByteTokenizer()


def make_documents(rng: random.Random, count: int, *, longest: int = 120) -> list[str]:
    """Documents of 0 to `longest` words: empty ones, short ones, and ones longer than a unit."""
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, longest))) for _ in range(count)]


def write_corpus(root: Path, shards: int, per_shard: int, *, seed: int = 0, txt: bool = True) -> list[str]:
    """`shards` shard files under `root` (jsonl, with a txt one every third unless not `txt`),
    the documents in the order a stream reads them (shards sorted by name)."""
    rng = random.Random(seed)
    documents: list[str] = []
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        docs = make_documents(rng, per_shard)
        if txt and s % 3 == 2:
            # a text shard: one document per line, Windows line ends on some
            lines = [doc + ("\r" if i % 4 == 0 else "") for i, doc in enumerate(docs)]
            (root / f"part-{s:03d}.txt").write_bytes(("\n".join(lines) + "\n").encode())
        else:
            rows = [json.dumps({"id": i, "text": doc, "lang": "x"}, ensure_ascii=i % 2 == 0) for i, doc in enumerate(docs)]
            (root / f"part-{s:03d}.jsonl").write_text("\n".join(rows) + ("\n" if s % 2 else ""), encoding="utf-8")
        documents.extend(docs)
    return documents


class CountingOpener:
    """Opens shard files and counts it, per shard; `fail_after[url] = n` makes the next open of
    `url` raise OSError once `n` bytes were read from it."""

    def __init__(self) -> None:
        self.opened: Counter[str] = Counter()
        self.fail_after: dict[str, int] = {}

    def __call__(self, url: str) -> BinaryIO:
        self.opened[url] += 1
        file = open_url(url)
        if url in self.fail_after:
            return FailingFile(file, self.fail_after.pop(url))
        return file


class FailingFile(io.RawIOBase):
    """A file whose reads fail once `budget` bytes were read: a connection lost mid-read."""

    def __init__(self, inner: BinaryIO, budget: int) -> None:
        self.inner, self.budget = inner, budget

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size)
        self.budget -= len(data)
        if self.budget < 0:
            raise ConnectionResetError("connection reset by peer")
        return data

    def close(self) -> None:
        self.inner.close()
        super().close()


def epoch_units(ledger: UnitLedger, members: list[str]) -> list[int]:
    """Advance `ledger` round after round with `members` until epoch 0 is handed out; every unit
    index handed out in it, in the order handed."""
    handed: list[int] = []
    round_ = 0
    while True:
        for _, units in sorted(ledger.advance(round_, members).items()):
            handed.extend(unit.index for unit in units if unit.epoch == 0)
        if ledger.epoch > 0 or ledger.cursor == ledger.units:
            return handed
        round_ += 1


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "corpus"
    return root, write_corpus(root, shards=6, per_shard=40)


def test_units_come_from_sizes_alone_and_name_a_shard_and_offset(corpus: tuple[Path, list[str]]) -> None:
    root, _ = corpus
    opener = CountingOpener()
    source = StreamSource(str(root), unit_bytes=256, opener=opener)
    sizes = {p.name: p.stat().st_size for p in root.iterdir()}
    assert [s.name for s in source.shards] == sorted(sizes)
    assert source.units == sum(-(-size // 256) for size in sizes.values())
    assert not opener.opened  # listing reads sizes, never the files
    place = source.locate(source.shards[2].first_unit + 3)
    assert (place.shard.name, place.rank, place.start, place.end) == (source.shards[2].name, 3, 768, 1024)
    last = source.locate(source.units - 1)
    assert last.end == last.shard.size and last.start < last.end
    with pytest.raises(IndexError, match=f"not one of the {source.units} units"):
        source.locate(source.units)


def test_an_epoch_streams_every_unit_once_and_every_document_whole(corpus: tuple[Path, list[str]]) -> None:
    root, documents = corpus
    opener = CountingOpener()
    source = StreamSource(str(root), unit_bytes=128, opener=opener)
    ledger = UnitLedger(source.units, seed=7)
    handed = epoch_units(ledger, ["a", "b", "c"])
    assert sorted(handed) == list(range(source.units))  # every unit once

    pieces = {index: source.unit_pieces(index) for index in handed}
    assert sum(opener.opened.values()) == source.units  # one read each
    # In unit order, the pieces make up every non-empty document, whole and once.
    rebuilt, held = [], []
    for index in range(source.units):
        for piece in pieces[index]:
            held.append(piece.text)
            if piece.ends_document:
                rebuilt.append("".join(held))
                held = []
    assert not held and rebuilt == [doc for doc in documents if doc]
    assert list(source.documents()) == rebuilt
    # The tokens of the epoch are the corpus's: every document's bytes and its end, once.
    total = sum(len(source.unit_tokens(index, BYTES)) for index in handed)
    assert total == sum(len(doc.encode()) + 1 for doc in documents if doc)
    # A unit holds about unit_bytes of text, though documents run to several units.
    longest = max(len(doc.encode()) for doc in documents)
    assert longest > 4 * source.unit_bytes
    assert max(len(source.unit_tokens(i, BYTES)) for i in range(source.units)) < 2 * source.unit_bytes


def test_resume_reads_the_same_units_as_the_run_that_went_on(corpus: tuple[Path, list[str]]) -> None:
    root, _ = corpus
    members = ["a", "b"]
    source = StreamSource(str(root), unit_bytes=300)
    going_on = UnitLedger(source.units, seed=3)
    for round_ in range(5):
        going_on.advance(round_, members)
    saved = json.loads(json.dumps(going_on.state_dict()))  # as a checkpoint holds it

    # a new process: the corpus listed again, the ledger from the checkpoint
    restarted_source = StreamSource(str(root), unit_bytes=300)
    restarted = UnitLedger(restarted_source.units, seed=3)
    restarted.load_state_dict(saved)
    for round_ in range(5, 9):
        expected = going_on.advance(round_, members)
        assert restarted.advance(round_, members) == expected
        for units in expected.values():
            for unit in units:
                want, got = source.unit_batch(unit.index, BYTES, 16), restarted_source.unit_batch(unit.index, BYTES, 16)
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert restarted.digest() == going_on.digest()


def test_a_read_that_fails_mid_shard_is_retried_and_the_epoch_completes(
    corpus: tuple[Path, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    root, _ = corpus
    clean = StreamSource(str(root), unit_bytes=256)
    opener = CountingOpener()
    source = StreamSource(str(root), unit_bytes=256, opener=opener, backoff_s=0.0)
    handed = epoch_units(UnitLedger(source.units, seed=1), ["a", "b", "c"])
    failing_at = len(handed) // 2
    read: dict[int, list] = {}
    with caplog.at_level(logging.WARNING, logger="starling.data.streaming"):
        for position, index in enumerate(handed):
            if position == failing_at:  # this unit's shard drops the connection 100 bytes in
                opener.fail_after[source.locate(index).shard.url] = 100
            read[index] = source.unit_pieces(index)
    shard = source.locate(handed[failing_at]).shard
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"retrying shard {shard.name} after ConnectionResetError: connection reset by peer")
    assert source.retried == 1
    assert sum(opener.opened.values()) == source.units + 1  # only the failed unit was read again
    assert sorted(read) == list(range(source.units))
    assert all(read[index] == clean.unit_pieces(index) for index in read)


def test_a_shard_that_keeps_failing_is_one_line_after_bounded_retries(corpus: tuple[Path, list[str]]) -> None:
    root, _ = corpus

    def broken(url: str) -> BinaryIO:
        raise TimeoutError("read timed out")

    source = StreamSource(str(root), unit_bytes=256, opener=broken, retries=2, backoff_s=0.0)
    with pytest.raises(DataError) as caught:
        source.unit_pieces(0)
    assert str(caught.value) == (f"shard {source.shards[0].name}: cannot read it after 3 tries: "
                                 "TimeoutError: read timed out")
    assert source.retried == 2


def test_the_first_batch_opens_one_shard_of_many(tmp_path: Path) -> None:
    root = tmp_path / "big"
    write_corpus(root, shards=24, per_shard=30)
    opener = CountingOpener()
    source = StreamSource(str(root), unit_bytes=512, opener=opener)
    ledger = UnitLedger(source.units, seed=0)
    [unit] = ledger.advance(0, ["me"])["me"]
    inputs, targets = source.unit_batch(unit.index, BYTES, 32)
    assert inputs.shape[1] == 32 and inputs.shape == targets.shape
    assert list(opener.opened) == [source.locate(unit.index).shard.url] and len(source.shards) == 24


def test_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    def peak(shards: int) -> int:
        root = tmp_path / f"c{shards}"
        write_corpus(root, shards=shards, per_shard=40, seed=1)
        source = StreamSource(str(root), unit_bytes=256)
        tracemalloc.start()
        try:
            for index in range(source.units):
                source.unit_tokens(index, BYTES)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(2), peak(16)  # 8x the corpus
    assert large < 2 * small


def test_parquet_shards_spread_their_rows_over_their_units(tmp_path: Path) -> None:
    root = tmp_path / "pq"
    root.mkdir()
    rng = random.Random(5)
    documents: list[str | None] = []
    for s in range(3):
        docs: list[str | None] = make_documents(rng, 90, longest=60)
        docs[3] = None
        pq.write_table(pa.table({"text": docs, "n": list(range(90))}), root / f"s{s}.parquet", row_group_size=16)
        documents.extend(docs)
    opener = CountingOpener()
    source = StreamSource(str(root), unit_bytes=512, opener=opener)
    assert all(s.kind == "parquet" and s.units > 1 for s in source.shards)
    handed = epoch_units(UnitLedger(source.units, seed=2), ["a", "b"])
    assert sorted(handed) == list(range(source.units))
    assert list(source.documents()) == [doc for doc in documents if doc]
    total = sum(len(source.unit_tokens(index, BYTES)) for index in handed)
    assert total == sum(len(doc.encode()) + 1 for doc in documents if doc)
    assert all(source.unit_pieces(i) for i in range(source.units))  # rows outnumber units: none is empty

    with pytest.raises(DataError, match=r"s0.parquet: no column 'body'; its columns are text, n"):
        StreamSource(str(root), unit_bytes=512, text_field="body").unit_pieces(0)


def test_a_url_glob_streams_through_fsspec(tmp_path: Path) -> None:
    import fsspec

    root = tmp_path / "local"
    documents = write_corpus(root, shards=4, per_shard=20, seed=9)
    memory = fsspec.filesystem("memory")
    for path in sorted(root.iterdir()):
        memory.pipe(f"/starling-test-corpus/{path.name}", path.read_bytes())
    try:
        source = StreamSource("memory://starling-test-corpus/part-*", unit_bytes=256)
        assert [s.url for s in source.shards] == [f"memory:///starling-test-corpus/{p.name}"
                                                   for p in sorted(root.iterdir())]
        assert list(source.documents()) == [doc for doc in documents if doc]
        folder = StreamSource("memory://starling-test-corpus", unit_bytes=256)
        assert folder.units == source.units
    finally:
        memory.rm("/starling-test-corpus", recursive=True)


def test_a_hub_name_streams_the_files_datasets_resolves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A data set folder stands in for the hub: datasets resolves its data files as it would a hub repository's.
    root = tmp_path / "hub" / "corpus"
    documents = write_corpus(root, shards=4, per_shard=10, txt=False)  # a hub data set has one format
    (root / "README.md").write_text("# a data set card\n")
    files = hub_files(str(root), "train")
    assert sorted(Path(f).name for f in files) == sorted(p.name for p in root.glob("part-*"))
    with pytest.raises(DataError, match="no split 'validation'; its splits are train"):
        hub_files(str(root), "validation")

    asked: list[tuple[str, str]] = []

    def resolve(name: str, split: str) -> list[str]:
        asked.append((name, split))
        return hub_files(str(root), split)

    monkeypatch.setattr(streaming, "hub_files", resolve)
    source = open_source("stream:owner/corpus")
    assert isinstance(source, StreamSource) and asked == [("owner/corpus", "train")]
    assert source.name == "stream:owner/corpus"
    assert list(source.documents()) == [doc for doc in documents if doc]


def test_pack_rows_cuts_rows_with_stride_seq_len_and_pads_the_last() -> None:
    inputs, targets = pack_rows(np.arange(10), 4, pad_id=99)
    assert inputs.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 99, 99]]
    assert targets.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    inputs, targets = pack_rows(np.arange(9), 4, pad_id=99)  # exactly two rows of seq_len + 1
    assert inputs.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and targets.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    for few in (np.zeros(0, dtype=np.int64), np.array([5])):
        inputs, targets = pack_rows(few, 4, pad_id=99)
        assert inputs.shape == (1, 4) and (targets == IGNORE_INDEX).all()
    loss = torch.nn.functional.cross_entropy(torch.zeros(4, 100), torch.tensor([1, 2, IGNORE_INDEX, IGNORE_INDEX]))
    assert torch.isclose(loss, torch.log(torch.tensor(100.0)))  # padded targets are left out


def test_open_source_names_a_stream_and_a_token_store_refuses_it(corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, _ = corpus
    source = open_source(f"stream:{root}", text_field="text")
    assert isinstance(source, StreamSource) and source.unit_bytes == streaming.DEFAULT_UNIT_BYTES
    with pytest.raises(DataError, match="read a unit at a time"):
        TokenStore.build(source, BYTES, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    assert source.fingerprint() == StreamSource(str(root)).fingerprint()
    assert source.fingerprint() != StreamSource(str(root), unit_bytes=1024).fingerprint()


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"no such file or folder: {tmp_path}/missing"):
        StreamSource(str(tmp_path / "missing"))
    with pytest.raises(DataError, match="name a folder, file, glob, URL or data set"):
        open_source("stream:")
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "a.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(DataError, match="compressed shards such as a.jsonl.gz cannot be read a unit at a time"):
        StreamSource(str(packed))
    with pytest.raises(DataError, match="unit_bytes must be at least 64"):
        StreamSource(str(packed), unit_bytes=8)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n{"body": "x"}\nnot json\n')
    source = StreamSource(str(bad), unit_bytes=64)
    with pytest.raises(DataError, match=r"a.jsonl: field 'text' of the line at byte 17 holds int, not text"):
        list(source.documents())
    source = StreamSource(str(bad), unit_bytes=1024)
    (bad / "a.jsonl").write_text('{"text": "fine"}\n')  # shorter than when it was listed
    with pytest.raises(DataError, match="a.jsonl: 17 bytes, not the 52 it had when listed"):
        source.unit_pieces(0)
    (bad / "a.jsonl").write_text('{"text": "fine"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"the line at byte 17 has no field 'text'; its fields are body"):
        list(StreamSource(str(bad)).documents())
    (bad / "a.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(DataError, match=r"a.jsonl: the line at byte 17 is not JSON"):
        list(StreamSource(str(bad)).documents())
    (bad / "a.jsonl").unlink()
    (bad / "b.txt").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"b.txt: not UTF-8 text: invalid start byte at byte 3"):
        list(StreamSource(str(bad)).documents())
