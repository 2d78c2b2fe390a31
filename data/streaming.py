"""A corpus read from its shard files a unit at a time: nothing is downloaded, copied or
converted whole, and memory holds one unit whatever the corpus's size.

`StreamSource(spec)` (`open_source("stream:" + spec)`, `--data stream:SPEC`) reads the shard
files `spec` names:

- a local folder (its `.jsonl`, `.txt` and `.parquet` files at any depth, in the order of their
  paths relative to it; other files are left out), one shard file, or a glob of them;
- a URL that `fsspec` opens, one file or a glob (``s3://bucket/corpus/*.jsonl``,
  ``hf://datasets/owner/name/data/*.parquet``);
- anything else is a data set on the Hugging Face Hub (``owner/name``): `datasets` resolves the
  data files of its default configuration's `split`, as `load_dataset(..., streaming=True)`
  does, and they are read with ranged reads (`fsspec`), never downloaded whole.

Documents: a `.txt` shard holds one document per line (a trailing carriage return is dropped),
a `.jsonl` shard one JSON object per line whose `text_field` is the document (null: empty), a
`.parquet` shard one document per row (its `text_field` column). An empty document adds nothing.
Compressed shards (`.jsonl.gz`, `.zst`) cannot be read a unit at a time and are refused.

Units. A shard of S bytes holds ceil(S / `unit_bytes`) units, numbered shard after shard, so
unit i is (shard, byte offset) and the corpus's unit count needs only the shards' sizes: no
shard is opened before its first unit is read. Unit k of a line shard covers the bytes
[k * B, (k + 1) * B) (B = `unit_bytes`): of every line whose bytes [a, b) overlap that range it
holds the share of the line's c characters in proportion to the overlap, the characters
[c * (max(a, lo) - a) // (b - a), c * (min(b, hi) - a) // (b - a)), and the end of each document
whose last byte lies in the range. A parquet shard's N rows are spread evenly over its U units
(row j at [j * U, (j + 1) * U) against unit k's [k * N, (k + 1) * N), shared the same way). So:

- every character of the corpus is in exactly one unit, and an epoch of units trains each once;
- a unit holds about B bytes of a line shard's text however long its documents are (a document
  longer than a unit is cut across units, as a token file's rows cut documents), and reading it
  reads its range and the lines that cross its two ends (a line much longer than a unit is read
  once for every unit it crosses);
- a parquet unit reads the row groups that hold its rows, so its cost follows the row groups'
  size.

A unit's tokens are its pieces' ids, each document's end followed by the tokenizer's `eos_id`;
`unit_batch` cuts them into rows of `seq_len + 1` tokens with stride `seq_len`, as a token file
is cut, and pads the last row (padded targets are `IGNORE_INDEX`, which `cross_entropy` skips).
The row count follows the unit's tokens: about B / (bytes per token) / seq_len.

A read that fails (an `OSError`, a network library's error) is retried `retries` times with a
backoff doubling from `backoff_s` up to `max_backoff_s`, each retry logged (``retrying shard X
after ...``); a unit is read whole or not at all, so a retry rereads only that unit, and the
units read before it stand. A shard whose size changed since it was listed, or whose content
cannot be parsed, is a `DataError` naming the shard and the byte, not retried.
"""
from __future__ import annotations

import bisect
import glob
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np
import torch

from .base import DataError, Source, _has_glob, _import_datasets, _one_line_cause, _regular_files
from .tokenizer import ByteTokenizer, Tokenizer

logger = logging.getLogger(__name__)

PREFIX = "stream:"
# shard suffix -> how its documents are laid out
SHARD_KINDS: dict[str, str] = {".jsonl": "jsonl", ".txt": "text", ".parquet": "parquet"}
COMPRESSED_SUFFIXES = frozenset({".gz", ".zst", ".zstd", ".bz2", ".xz", ".lz4", ".zip"})
DEFAULT_UNIT_BYTES = 1 << 16
MIN_UNIT_BYTES = 64
IGNORE_INDEX = -100  # a target `torch.nn.functional.cross_entropy` leaves out (its default ignore_index)
READ_CHUNK = 1 << 16  # bytes read at a time past a unit's range, to find where a line ends
PARQUET_FOOTERS_KEPT = 64
# an exception raised in these libraries is the network's or the storage's, and worth a retry
NETWORK_MODULES = frozenset({"aiohttp", "httpx", "httpcore", "requests", "urllib3", "fsspec", "huggingface_hub",
                             "botocore", "s3fs", "gcsfs", "adlfs"})

Opener = Callable[[str], BinaryIO]
T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """One shard file: `name` as listed (a path relative to the corpus's folder, or a URL), `url`
    what is opened, its `size` in bytes and `kind` (jsonl, text or parquet), and its units,
    `first_unit` onwards. `stamp` is what else tells its content (a local file's mtime)."""

    name: str
    url: str
    size: int
    kind: str
    first_unit: int
    units: int
    stamp: str = ""


@dataclass(frozen=True)
class UnitPlace:
    """Where unit `index` lies: `shard`'s positions [`start`, `end`) (bytes of a line shard; for a
    parquet shard, row positions scaled as the module says), unit `rank` of the shard."""

    index: int
    shard: Shard
    rank: int
    start: int
    end: int


@dataclass(frozen=True)
class Piece:
    """A unit's share of one document: its text, and whether the document ends in this unit."""

    text: str
    ends_document: bool


def is_stream_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def default_unit_bytes(batch_size: int, seq_len: int, tokenizer: Tokenizer) -> int:
    """Bytes of text that fill about `batch_size` rows of `seq_len` tokens: a byte for each of
    the byte tokenizer's tokens, four for any other's (a trained tokenizer's average on English
    text)."""
    per_token = 1 if isinstance(tokenizer, ByteTokenizer) else 4
    return max(MIN_UNIT_BYTES, batch_size * seq_len * per_token)


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, (OSError, EOFError)):
        return True
    return any(kind.__module__.split(".")[0] in NETWORK_MODULES for kind in type(exc).__mro__)


def _is_url(spec: str) -> bool:
    return "://" in spec


def open_url(url: str, *, block_size: int = READ_CHUNK) -> BinaryIO:
    """`url` opened for reading bytes: a local path with `open`, anything else with `fsspec`
    (ranged reads of `block_size` bytes ahead, not the whole file)."""
    if not _is_url(url):
        return open(url, "rb")  # the caller closes it
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs.open(path, "rb", block_size=block_size)  # type: ignore[no-any-return]


def _local_files(spec: str) -> list[tuple[str, str, int, str]] | None:
    """(name, path, size, stamp) of the shard files `spec` names on this machine, sorted by
    name; None when it names nothing here."""
    path = Path(spec).expanduser()
    if path.is_file():
        found = [(path.name, path)]
    elif path.is_dir():
        found = _regular_files(path, recursive=True)
    elif _has_glob(spec):
        found = [(match, Path(match)) for match in sorted(glob.glob(os.path.expanduser(spec), recursive=True))]
        found = [(name, file) for name, file in found if file.is_file()]
    else:
        return None
    files = []
    for name, file in found:
        try:
            stat = file.stat()
        except OSError as exc:
            raise DataError(f"{file}: cannot read: {exc.strerror or exc}") from None
        files.append((name, str(file), stat.st_size, str(stat.st_mtime_ns)))
    return files


def _url_files(spec: str) -> list[tuple[str, str, int, str]]:
    """(url, url, size, "") of the files a URL or URL glob names (listed, not opened)."""
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(spec)
        if _has_glob(path):
            infos = fs.glob(path, detail=True)
        else:
            info = fs.info(path)
            infos = fs.find(path, detail=True) if info.get("type") == "directory" else {path: info}
    except FileNotFoundError:
        return []
    except Exception as exc:  # fsspec backends raise their own kinds; each is a failure to list
        raise DataError(f"{spec}: cannot list: {_one_line_cause(exc)}") from None
    files = []
    for path_, info in sorted(infos.items()):
        if info.get("type", "file") != "file":
            continue
        url = fs.unstrip_protocol(path_)
        files.append((url, url, int(info["size"]), ""))
    return files


def hub_files(name: str, split: str) -> list[str]:
    """The data files of `split` of the data set `name` (its default configuration), as
    `datasets` resolves them for `load_dataset(name, split=split, streaming=True)`: URLs pinned to
    the revision it resolved (or local paths, when `name` is a local data set folder)."""
    datasets = _import_datasets()
    try:
        builder = datasets.load_dataset_builder(name)
    except Exception as exc:  # datasets raises many kinds; each is the same failure to the user
        raise DataError(f"{name}: cannot resolve its data files: {_one_line_cause(exc)}") from None
    data_files = builder.config.data_files
    if not data_files:
        raise DataError(f"{name}: names no data files (a data set built by a script cannot be read by shards)")
    for key, files in data_files.items():
        if str(key) == split:
            return [str(file) for file in files]
    raise DataError(f"{name}: no split {split!r}; its splits are {', '.join(sorted(map(str, data_files)))}")


def _shard_kind(name: str) -> str | None:
    return SHARD_KINDS.get(Path(name.split("?")[0]).suffix.lower())


class StreamSource(Source):
    """A corpus read from its shard files a unit at a time (see the module).

    `opener` opens a shard's `url` for reading bytes (default: `open_url`; tests pass their
    own). `retries`, `backoff_s` and `max_backoff_s` bound how a failing read is retried.
    """

    def __init__(
        self,
        spec: str,
        *,
        unit_bytes: int = DEFAULT_UNIT_BYTES,
        text_field: str = "text",
        split: str = "train",
        retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        opener: Opener | None = None,
    ) -> None:
        spec = spec[len(PREFIX):] if is_stream_spec(spec) else spec
        if not spec:
            raise DataError(f"{PREFIX}: name a folder, file, glob, URL or data set after it")
        if unit_bytes < MIN_UNIT_BYTES:
            raise DataError(f"{PREFIX}{spec}: unit_bytes must be at least {MIN_UNIT_BYTES}, got {unit_bytes}")
        if retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise DataError(f"{PREFIX}{spec}: retries and backoffs must be >= 0")
        self.spec = spec
        self.name = PREFIX + spec
        self.unit_bytes = unit_bytes
        self.text_field = text_field
        self.split = split
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        block = max(READ_CHUNK, 2 * unit_bytes)
        self._opener: Opener = opener if opener is not None else (lambda url: open_url(url, block_size=block))
        self._lock = threading.Lock()
        self._footers: OrderedDict[str, Any] = OrderedDict()  # url -> a parquet shard's metadata
        self.opens = 0  # shard files opened so far
        self.retried = 0  # reads retried so far
        self.shards = self._list()
        self._firsts = [shard.first_unit for shard in self.shards]
        self.units = self.shards[-1].first_unit + self.shards[-1].units

    # ------------------------------------------------------------------ listing
    def _list(self) -> list[Shard]:
        spec = self.spec
        files = _url_files(spec) if _is_url(spec) else _local_files(spec)
        if files is None:
            if spec.startswith((".", "~", "/")) or spec.count("/") > 1 or _shard_kind(spec):
                raise DataError(f"no such file or folder: {spec}")
            files = []
            for url in hub_files(spec, self.split):
                listed = _url_files(url) if _is_url(url) else _local_files(url)
                if not listed:
                    raise DataError(f"{url}: a data file of {spec} that cannot be found")
                files.extend((url, url, size, stamp) for _, _, size, stamp in listed)
        shards: list[Shard] = []
        skipped: list[str] = []
        first = 0
        for name, url, size, stamp in sorted(files):
            kind = _shard_kind(name)
            if kind is None:
                skipped.append(name)
                continue
            units = max(1, math.ceil(size / self.unit_bytes)) if size else 0
            if units == 0:
                continue  # an empty shard holds no document
            shards.append(Shard(name, url, size, kind, first, units, stamp))
            first += units
        if not shards:
            compressed = [name for name in skipped if Path(name).suffix.lower() in COMPRESSED_SUFFIXES]
            why = (f"; compressed shards such as {compressed[0]} cannot be read a unit at a time" if compressed
                   else "")
            raise DataError(f"{self.name}: no shard files with data ({' '.join(SHARD_KINDS)}){why}")
        return shards

    def fingerprint(self) -> str:
        entries = [[s.name, s.size, s.stamp] for s in self.shards]
        key = [entries, self.unit_bytes, self.text_field]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()

    # ------------------------------------------------------------------ units
    def locate(self, index: int) -> UnitPlace:
        """Where unit `index` lies (IndexError outside [0, units))."""
        if not 0 <= index < self.units:
            raise IndexError(f"unit {index} is not one of the {self.units} units of {self.name}")
        shard = self.shards[bisect.bisect_right(self._firsts, index) - 1]
        rank = index - shard.first_unit
        return UnitPlace(index, shard, rank, rank * self.unit_bytes, min(shard.size, (rank + 1) * self.unit_bytes))

    def unit_pieces(self, index: int) -> list[Piece]:
        """Unit `index`'s share of each document it holds, in order (retried as the module says)."""
        place = self.locate(index)
        reader = self._parquet_pieces if place.shard.kind == "parquet" else self._line_pieces
        return self._retrying(place.shard, lambda: reader(place))

    def unit_tokens(self, index: int, tokenizer: Tokenizer) -> np.ndarray:
        """Unit `index`'s token ids (int64): each piece's ids, and `eos_id` after each document's end."""
        pieces = self.unit_pieces(index)
        encoded = tokenizer.encode_batch([piece.text for piece in pieces]) if pieces else []
        parts: list[np.ndarray] = []
        eos = np.array([tokenizer.eos_id], dtype=np.int64)
        for piece, ids in zip(pieces, encoded):
            parts.append(np.asarray(ids, dtype=np.int64))
            if piece.ends_document:
                parts.append(eos)
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size):
            raise DataError(f"tokenizer {tokenizer.name}: produced an id outside its vocab_size "
                            f"{tokenizer.vocab_size} for unit {index} of {self.name}")
        return tokens

    def unit_batch(self, index: int, tokenizer: Tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit `index` as inputs and targets, int64 tensors of shape (rows, `seq_len`)
        (`pack_rows`)."""
        return pack_rows(self.unit_tokens(index, tokenizer), seq_len, tokenizer.eos_id)

    def documents(self) -> Iterator[str]:
        """Every non-empty document, whole, in order: the units read one after another."""
        held: list[str] = []
        for index in range(self.units):
            for piece in self.unit_pieces(index):
                held.append(piece.text)
                if piece.ends_document:
                    yield "".join(held)
                    held = []
        if held:  # unreachable for well-formed shards: every document ends in some unit
            yield "".join(held)

    # ------------------------------------------------------------------ reading
    def _retrying(self, shard: Shard, read: Callable[[], T]) -> T:
        failures = 0
        while True:
            try:
                return read()
            except DataError:
                raise
            except Exception as exc:
                if not _retryable(exc):
                    raise
                failures += 1
                cause = _one_line_cause(exc)
                if failures > self.retries:
                    raise DataError(f"shard {shard.name}: cannot read it after {failures} tries: {cause}") from None
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))
                logger.warning("retrying shard %s after %s (try %d of %d, in %.1f s)",
                               shard.name, cause, failures + 1, self.retries + 1, delay)
                with self._lock:
                    self.retried += 1
                time.sleep(delay)

    def _open(self, shard: Shard) -> BinaryIO:
        file = self._opener(shard.url)
        with self._lock:
            self.opens += 1
        try:
            size = file.seek(0, os.SEEK_END)
        except BaseException:
            file.close()
            raise
        if size != shard.size:
            file.close()
            raise DataError(f"shard {shard.name}: {size} bytes, not the {shard.size} it had when listed "
                            "(it changed during the run)")
        return file

    def _line_pieces(self, place: UnitPlace) -> list[Piece]:
        shard, lo, hi = place.shard, place.start, place.end
        with self._open(shard) as file:
            start = _line_start(file, lo)
            file.seek(start)
            data = bytearray(_read_exactly(file, hi - start, shard))
            # read on to the end of the line holding the range's last byte
            last = hi - 1 - start
            while data.find(b"\n", last) < 0:
                more = file.read(READ_CHUNK)
                if not more:
                    break
                data += more
        cut = data.find(b"\n", last)
        if cut >= 0:
            del data[cut + 1:]
        pieces: list[Piece] = []
        position = start
        for line in bytes(data).split(b"\n"):
            begin = position
            end = begin + len(line) + 1  # the newline is the line's last byte
            if end > shard.size:  # the shard's last line, without a newline
                end = shard.size
            position = begin + len(line) + 1
            if begin >= hi or end <= begin:
                break  # the empty tail after the last newline
            text = self._line_text(shard, line, begin)
            _share(pieces, text, begin, end, lo, hi)
        return pieces

    def _line_text(self, shard: Shard, line: bytes, at: int) -> str:
        if shard.kind == "text":
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"shard {shard.name}: not UTF-8 text: {exc.reason} at byte {at + exc.start}") from None
            return text[:-1] if text.endswith("\r") else text
        if not line.strip():
            return ""
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DataError(f"shard {shard.name}: the line at byte {at} is not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise DataError(f"shard {shard.name}: the line at byte {at} is not a JSON object")
        if self.text_field not in row:
            raise DataError(f"shard {shard.name}: the line at byte {at} has no field {self.text_field!r}; "
                            f"its fields are {', '.join(row) or 'none'}")
        text = row[self.text_field]
        if text is None:
            return ""
        if not isinstance(text, str):
            raise DataError(f"shard {shard.name}: field {self.text_field!r} of the line at byte {at} holds "
                            f"{type(text).__name__}, not text")
        return text

    def _parquet_pieces(self, place: UnitPlace) -> list[Piece]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        shard = place.shard
        with self._open(shard) as file:
            try:
                with self._lock:
                    footer = self._footers.get(shard.url)
                parquet = pq.ParquetFile(file, metadata=footer)
                if footer is None:
                    with self._lock:
                        self._footers[shard.url] = parquet.metadata
                        while len(self._footers) > PARQUET_FOOTERS_KEPT:
                            self._footers.popitem(last=False)
                schema = parquet.schema_arrow
                if self.text_field not in schema.names:
                    raise DataError(f"shard {shard.name}: no column {self.text_field!r}; its columns are "
                                    f"{', '.join(schema.names) or 'none'}")
                kind = schema.field(self.text_field).type
                if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                    raise DataError(f"shard {shard.name}: column {self.text_field!r} holds {kind}, not text")
                rows, units, k = parquet.metadata.num_rows, shard.units, place.rank
                lo, hi = k * rows, (k + 1) * rows  # the unit, in row positions scaled by `units`
                first, last = lo // units, -(-hi // units)  # the rows that overlap it: [first, last)
                texts = _parquet_rows(parquet, self.text_field, first, last)
            except pa.ArrowException as exc:
                if isinstance(exc, OSError):
                    raise  # a read that failed: retried
                raise DataError(f"shard {shard.name}: not a parquet file it can read: {exc}") from None
        pieces: list[Piece] = []
        for j, text in zip(range(first, last), texts):
            _share(pieces, "" if text is None else text, j * units, (j + 1) * units, lo, hi)
        return pieces


def _share(pieces: list[Piece], text: str, begin: int, end: int, lo: int, hi: int) -> None:
    """Append the share of `text` (a document at positions [begin, end)) that the unit at
    [lo, hi) holds: characters in proportion to the overlap, and the document's end when its
    last position lies in the unit."""
    if not text:
        return
    length, chars = end - begin, len(text)
    first = chars * (max(begin, lo) - begin) // length
    last = chars * (min(end, hi) - begin) // length
    ends = lo < end <= hi
    if last > first or ends:
        pieces.append(Piece(text[first:last], ends))


def _read_exactly(file: BinaryIO, size: int, shard: Shard) -> bytes:
    data = bytearray()
    while len(data) < size:
        more = file.read(size - len(data))
        if not more:
            raise EOFError(f"shard {shard.name} ended {size - len(data)} bytes early")
        data += more
    return bytes(data)


def _line_start(file: BinaryIO, position: int) -> int:
    """Where the line holding byte `position` begins: after the last newline before it."""
    end = position
    while end > 0:
        begin = max(0, end - READ_CHUNK)
        file.seek(begin)
        chunk = file.read(end - begin)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            return begin + newline + 1
        end = begin
    return 0


def _parquet_rows(parquet: Any, field: str, first: int, last: int) -> list[Any]:
    """Column `field` of rows [first, last), from the row groups that hold them."""
    texts: list[Any] = []
    start = 0
    metadata = parquet.metadata
    for group in range(metadata.num_row_groups):
        count = metadata.row_group(group).num_rows
        stop = start + count
        if stop > first and start < last:
            column = parquet.read_row_group(group, columns=[field]).column(field)
            lo, hi = max(first, start) - start, min(last, stop) - start
            texts.extend(column.slice(lo, hi - lo).to_pylist())
        if stop >= last:
            break
        start = stop
    return texts


def pack_rows(tokens: np.ndarray, seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens` as rows of `seq_len + 1` tokens with stride `seq_len`: inputs are a row's first
    `seq_len`, targets its last `seq_len` (int64 tensors of shape (rows, seq_len)). The last row
    is padded: inputs with `pad_id`, targets with `IGNORE_INDEX`. Fewer than two tokens make one
    row whose targets are all `IGNORE_INDEX` (nothing to train)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    count = max(1, -(-(tokens.size - 1) // seq_len))
    length = count * seq_len + 1
    inputs_flat = np.full(length, pad_id, dtype=np.int64)
    targets_flat = np.full(length, IGNORE_INDEX, dtype=np.int64)
    inputs_flat[:tokens.size] = tokens
    if tokens.size >= 2:
        targets_flat[:tokens.size] = tokens
    positions = np.arange(count, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len, dtype=np.int64)
    inputs = torch.from_numpy(np.ascontiguousarray(inputs_flat[positions]))
    targets = torch.from_numpy(np.ascontiguousarray(targets_flat[positions + 1]))
    return inputs, targets


def stream_units(source: StreamSource, indices: Sequence[int], tokenizer: Tokenizer,
                 seq_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of `indices`, in order (wrap in a `Prefetcher` to read ahead)."""
    for index in indices:
        yield source.unit_batch(int(index), tokenizer, seq_len)
