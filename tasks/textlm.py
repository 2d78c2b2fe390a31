"""`gpt`: a GPT language model trained on a user's text: files, a folder, or a Hugging Face data set.

`data` names the corpus (`starling.data.sources.open_source`: "" is the running Python's own
standard library source, which needs no download), `tokenizer` how it becomes ids ("bytes", or
a `tokenizer.json`). The corpus is tokenized once into a memory-mapped token file under
`cache_dir`, then cut into rows of `seq_len + 1` tokens; a unit is `batch_size` consecutive
rows, one step's batch. The last `eval_fraction` of the units is held out for evaluation.

Units are what a swarm hands out (`starling.data.assignment`): the runtime asks `unit_batch(i)`
for the units its ledger gives this peer. `batches(rank, world, seed)` is for code that runs the
task without a swarm's ledger: the epoch's order, every `world`-th unit from `rank`.

A `data` of ``stream:SPEC`` is not tokenized into a file: its shard files are read a unit at a time
(`starling.data.streaming.StreamSource`), a unit being `unit_bytes` bytes of one shard (0: about
`batch_size` rows, `default_unit_bytes`), whose tokens make as many rows as they fill; the last
`eval_fraction` of its units is held out the same way. A streamed corpus is not partitioned.

`partition` (``iid``, ``dirichlet:ALPHA``, ``shards:K``, `tasks/partition.py`) makes the data
federated: each peer trains only its own part of the units, as Flower's partitioner of that name
cuts them by label, and there is no swarm ledger (`data_units()` is None: a peer that leaves
takes its data with it). A unit's label is that of the document its first token belongs to, and
`partition_by` says what labels a document: ``document`` (each its own), ``folder`` (a text
folder's subfolders) or a column of a table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from starling.common.devices import to_model_device
from starling.data.assignment import epoch_order
from starling.data.prefetch import Prefetcher
from starling.data.sources import DOCUMENT, DataError, Source, open_source
from starling.data.streaming import IGNORE_INDEX, StreamSource, default_unit_bytes, is_stream_spec
from starling.data.tokenizer import Tokenizer, load_tokenizer
from starling.data.tokens import TokenStore

from .base import Task, check_rank, evaluating, make_generator
from .gpt import GPT, GPTConfig
from .partition import Partition

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs (B, T) and next-token targets (B, T), int64


@dataclass(frozen=True)
class TextDataConfig:
    """The options of a task on a tokenized corpus: what the corpus is, how it becomes units,
    and how it is partitioned. A task on `TextLMTask`'s data adds its model's options to them."""

    data: str = ""  # a folder, a file (.txt .jsonl .csv .parquet), a glob, or a dataset name; "" = stdlib
    tokenizer: str = "bytes"  # "bytes", a tokenizer.json, or a transformers tokenizer's folder or hub name
    seq_len: int = 128
    batch_size: int = 8
    text_field: str = "text"  # the column that holds the text, for tabular files and datasets
    split: str = "train"
    cache_dir: str = ""  # where token files go; "" = ~/.cache/starling/tokens
    eval_fraction: float = 0.02  # of the units, held out
    eval_batches: int = 4  # held-out units an evaluation reads (the first ones)
    partition: str = ""  # iid, dirichlet:ALPHA or shards:K: each peer its own units; "": the swarm's ledger
    partition_by: str = DOCUMENT  # what labels a document: document, folder, or a table's column
    unit_bytes: int = 0  # with a stream: data, bytes of a shard per unit; 0: about batch_size rows

    def __post_init__(self) -> None:
        for field in ("seq_len", "batch_size", "eval_batches"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.unit_bytes < 0:
            raise ValueError(f"unit_bytes must be >= 0 (0: about batch_size rows), got {self.unit_bytes}")
        if self.partition and is_stream_spec(self.data):
            raise ValueError("partition cuts a tokenized corpus by its documents' labels; a stream: corpus is read "
                             "a unit at a time, its documents unknown before they are read")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.partition:
            Partition.parse(self.partition)
        if not self.partition_by:
            raise ValueError("partition_by must name what labels a document (document, folder or a column)")


@dataclass(frozen=True)
class TextLMConfig(TextDataConfig):
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    seed: int = 0  # the model's initial weights

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("n_layer", "n_head", "n_embd"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over the targets that are not `IGNORE_INDEX` (a streamed unit pads
    its last row with it), and 0, not NaN, for a batch with none (a unit that holds no text)."""
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat, reduction="sum")
    return total / (flat != IGNORE_INDEX).sum().clamp(min=1)


class TextLMTask(Task):
    """A GPT on the units of a tokenized corpus (see the module). A subclass with another model
    overrides `make_model` and `loss`, and takes a `TextDataConfig` with its model's options."""

    name = "gpt"
    config_class = TextLMConfig

    def __init__(self, config: TextLMConfig | None = None) -> None:
        self.config = config or TextLMConfig()
        self._lock = threading.Lock()  # the peers of a simulator share one task
        self._store: TokenStore | None = None
        self._stream: StreamSource | None = None
        self._source: Source | None = None  # the corpus the store was built from
        self._unit_labels: np.ndarray | None = None
        self._parts: dict[tuple[int, int], list[np.ndarray]] = {}

    # ------------------------------------------------------------------ data
    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.config.tokenizer)

    @property
    def store(self) -> TokenStore:
        """The corpus's tokens, tokenized on first use (and found in the cache after that)."""
        with self._lock:
            if self._store is None:
                cache = Path(self.config.cache_dir or Path.home() / ".cache" / "starling" / "tokens")
                self._source = open_source(self.config.data, text_field=self.config.text_field,
                                           split=self.config.split)
                self._store = TokenStore.build(self._source, self.tokenizer, cache)
            return self._store

    @property
    def streaming(self) -> bool:
        """Whether `data` is read a unit at a time from its shard files (``stream:``)."""
        return is_stream_spec(self.config.data)

    @property
    def stream(self) -> StreamSource:
        """The streamed corpus (``stream:`` data): its shards listed on first use, never read whole."""
        with self._lock:
            if self._stream is None:
                c = self.config
                unit_bytes = c.unit_bytes or default_unit_bytes(c.batch_size, c.seq_len, self.tokenizer)
                self._stream = StreamSource(c.data, unit_bytes=unit_bytes, text_field=c.text_field, split=c.split)
            return self._stream

    @functools.cached_property
    def _split(self) -> tuple[int, int]:
        """(training units, held-out units)."""
        if self.streaming:
            total = self.stream.units
            what = f"{self.stream.unit_bytes} bytes"
        else:
            total = self.store.rows(self.config.seq_len) // self.config.batch_size
            what = f"{self.config.batch_size} x {self.config.seq_len + 1} tokens"
        held_out = max(1, math.floor(total * self.config.eval_fraction))
        if total - held_out < 1:
            smaller = "unit_bytes" if self.streaming else "seq_len or batch_size"
            raise ValueError(f"the corpus {self.config.data or 'stdlib'!r} has {total} unit(s) of {what}: too few "
                             f"to hold one out and train on another (a smaller {smaller}?)")
        return total - held_out, held_out

    def data_units(self) -> int | None:
        """The training units the swarm's ledger hands out; None for a partitioned corpus (each
        peer trains its own part), whose labels are read now: a bad `partition_by` fails here."""
        if self.config.partition:
            self.unit_labels()
            return None
        return self._split[0]

    def unit_labels(self) -> np.ndarray:
        """The label of each training unit (int64): that of the document its first token is in."""
        if self._unit_labels is not None:
            return self._unit_labels
        store = self.store
        source = self._source
        assert source is not None  # set with the store
        labels = source.labels(self.config.partition_by)
        ends = store.document_ends(self.tokenizer.eos_id)
        if len(ends) != len(labels):
            raise DataError(f"{source.name}: {len(labels)} documents but {len(ends)} end tokens in its token file "
                            "(the text holds the tokenizer's end id?): cannot tell a unit's document")
        starts = np.arange(self._split[0], dtype=np.int64) * self.config.batch_size * self.config.seq_len
        self._unit_labels = labels[np.searchsorted(ends, starts, side="left")]
        return self._unit_labels

    def partition_units(self, rank: int, world: int, seed: int) -> np.ndarray:
        """The training units peer `rank` of `world` owns under `partition` (sorted); ValueError
        if the draw leaves it none."""
        check_rank(rank, world)
        key = (world, seed)
        with self._lock:
            parts = self._parts.get(key)
        if parts is None:
            # a Dirichlet draw is redrawn until every peer holds a unit (Flower's min_partition_size)
            partition = dataclasses.replace(Partition.parse(self.config.partition), min_size=1)
            parts = partition.indices(self.unit_labels(), world, seed)
            with self._lock:
                self._parts[key] = parts
        if not len(parts[rank]):
            raise ValueError(f"partition {self.config.partition} of {self._split[0]} units over {world} peers "
                             f"leaves peer {rank} none: more data, a larger alpha, or smaller units")
        return parts[rank]

    def unit_batch(self, index: int) -> Batch:
        units = self._split[0]
        if not 0 <= index < units:
            raise IndexError(f"unit {index} is not one of the {units} training units")
        return self._unit(index)

    def _unit(self, index: int) -> Batch:
        if self.streaming:
            return self.stream.unit_batch(index, self.tokenizer, self.config.seq_len)
        size = self.config.batch_size
        return self.store.batch(range(index * size, (index + 1) * size), self.config.seq_len)

    def shard_batches(self, rank: int, world: int, seed: int) -> int | None:
        """One epoch of `batches(rank, world, seed)`: the peer's part under `partition`, else
        every `world`-th training unit from `rank`."""
        check_rank(rank, world)
        if self.config.partition:
            return len(self.partition_units(rank, world, seed))
        return len(range(rank, self._split[0], world))

    def batch_work(self, batch: Batch) -> float:
        """The share of the batch's targets that are text (a streamed unit pads its last row)."""
        targets = batch[1]
        return float((targets != IGNORE_INDEX).sum()) / max(1, targets.numel())

    def batches(self, rank: int, world: int, seed: int) -> Iterator[Batch]:
        check_rank(rank, world)
        if self.config.partition:
            self.partition_units(rank, world, seed)  # a peer with no units is an error now, not in the prefetcher
        return Prefetcher(self._shard(rank, world, seed))

    def _shard(self, rank: int, world: int, seed: int) -> Iterator[Batch]:
        if self.config.partition:
            mine = self.partition_units(rank, world, seed)
            generator = make_generator("gpt.partition", seed, rank, world)
            while True:  # an epoch: this peer's units in a fresh order
                for position in torch.randperm(len(mine), generator=generator).tolist():
                    yield self._unit(int(mine[position]))
        units, epoch = self._split[0], 0
        while True:
            order = epoch_order(units, seed, epoch)
            for position in range(rank, units, world):
                yield self._unit(int(order[position]))
            epoch += 1

    # ------------------------------------------------------------------ model
    def make_model(self) -> nn.Module:
        c = self.config
        config = GPTConfig(vocab_size=self.tokenizer.vocab_size, block_size=c.seq_len, n_layer=c.n_layer,
                           n_head=c.n_head, n_embd=c.n_embd)
        return GPT.build(config, make_generator("gpt-init", c.seed))

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = (to_model_device(t, model) for t in batch)
        logits = model(x)
        if self.streaming:
            return token_loss(logits, y)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        train_units, held_out = self._split
        losses = []
        with evaluating(model):
            for index in range(train_units, train_units + min(held_out, self.config.eval_batches)):
                losses.append(float(self.loss(model, self._unit(index))))
        return {"eval_loss": sum(losses) / len(losses)}
