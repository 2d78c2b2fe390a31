"""`charlm`: a character-level GPT trained on the Python standard library's own source.

The corpus needs no download: it is the sorted top-level ``*.py`` files of the running
interpreter's stdlib, concatenated and capped at `corpus_chars` characters. The vocabulary is
fixed (tab, newline, printable ASCII, one unknown token), so it does not depend on the machine;
the text itself does depend on the Python version, like any stdlib file.

The last `eval_fraction` of the corpus is held out. Of the rest, peer `rank` of `world` owns the
`rank`-th contiguous slice and samples random windows from it, seeded by (seed, rank, world).

With `partition` (``iid``, ``dirichlet:ALPHA``, ``shards:K``, `tasks/partition.py`) the training
split is cut into blocks of `seq_len` characters instead, each labelled by the stdlib file it
starts in, and peer `rank` samples windows that start at the blocks Flower's partitioner of that
name gives it: with a small alpha each peer reads a few modules' code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sysconfig
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from starling.common.devices import to_model_device

from .base import Task, check_rank, evaluating, make_generator
from .gpt import GPT, GPTConfig
from .partition import Partition

VOCAB = "\t\n" + "".join(chr(code) for code in range(32, 127))
UNKNOWN_ID = len(VOCAB)
VOCAB_SIZE = len(VOCAB) + 1  # 98



def _code_point_lookup() -> np.ndarray:
    """Code point -> token id for code points 0..255; anything above 255 looks up index 256."""
    lookup = np.full(257, UNKNOWN_ID, dtype=np.uint8)
    lookup[[ord(char) for char in VOCAB]] = np.arange(len(VOCAB), dtype=np.uint8)
    return lookup


_LOOKUP = _code_point_lookup()


Batch = tuple[torch.Tensor, torch.Tensor]  # inputs (B, T) and next-token targets (B, T), int64


def encode(text: str) -> torch.Tensor:
    """Text -> uint8 token ids; characters outside the vocabulary become `UNKNOWN_ID`."""
    code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return torch.from_numpy(_LOOKUP[np.minimum(code_points, 256)])


def decode(ids: torch.Tensor | list[int]) -> str:
    """Token ids -> text; the unknown token prints as U+FFFD."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return "".join(VOCAB[i] if i < len(VOCAB) else "\ufffd" for i in values)


def stdlib_source_files() -> list[Path]:
    """The interpreter's top-level stdlib ``*.py`` files, sorted by name."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name)


_corpus_lock = threading.Lock()


def load_corpus(corpus_chars: int) -> torch.Tensor:
    """The encoded corpus (uint8, read-only by convention), read once per process and size."""
    with _corpus_lock:  # peers starting together in one process read the stdlib once
        return _load_corpus(corpus_chars)


@functools.lru_cache(maxsize=4)
def _load_corpus(corpus_chars: int) -> torch.Tensor:
    return encode("".join(_corpus_files(corpus_chars))[:corpus_chars])


def corpus_file_starts(corpus_chars: int) -> np.ndarray:
    """Where each of the corpus's files starts in it (int64, ascending, the first 0)."""
    with _corpus_lock:
        lengths = [len(text) for text in _corpus_files(corpus_chars)]
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


@functools.lru_cache(maxsize=4)
def _corpus_files(corpus_chars: int) -> tuple[str, ...]:
    parts: list[str] = []
    total = 0
    for path in stdlib_source_files():
        if total >= corpus_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace") + "\n"
        parts.append(text)
        total += len(text)
    if total == 0:
        raise RuntimeError(
            f"no Python sources found in the stdlib at {sysconfig.get_paths()['stdlib']!r}; "
            "the charlm task needs them as its corpus"
        )
    return tuple(parts)


@dataclass(frozen=True)
class CharLMConfig:
    seed: int = 0  # initial weights
    corpus_chars: int = 2_000_000
    eval_fraction: float = 0.1  # tail of the corpus held out for evaluate()
    seq_len: int = 64  # training window, also the model's block_size
    batch_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_weights: bool = True
    eval_batches: int = 8
    partition: str = ""  # iid, dirichlet:ALPHA or shards:K over blocks labelled by file; "": contiguous slices

    def __post_init__(self) -> None:
        for field in ("corpus_chars", "seq_len", "batch_size", "eval_batches"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        self.gpt_config()  # validates the model fields
        if self.partition:
            Partition.parse(self.partition)

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=VOCAB_SIZE,
            block_size=self.seq_len,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
            tie_weights=self.tie_weights,
        )


class CharLMTask(Task):
    name = "charlm"
    config_class = CharLMConfig

    def __init__(self, config: CharLMConfig | None = None) -> None:
        self.config = config or CharLMConfig()
        self._eval_set: Batch | None = None

    # ------------------------------------------------------------------ data

    def splits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(train, held-out) token ids."""
        corpus = load_corpus(self.config.corpus_chars)
        n_train = int(len(corpus) * (1.0 - self.config.eval_fraction))
        return corpus[:n_train], corpus[n_train:]

    def shard(self, rank: int, world: int) -> torch.Tensor:
        """Peer `rank`'s contiguous slice of the training split."""
        check_rank(rank, world)
        train, _ = self.splits()
        lo, hi = len(train) * rank // world, len(train) * (rank + 1) // world
        if hi - lo < self.config.seq_len + 1:
            raise ValueError(
                f"charlm shard of rank {rank}/{world} has {hi - lo} tokens, fewer than "
                f"seq_len + 1 = {self.config.seq_len + 1}; raise corpus_chars or lower world"
            )
        return train[lo:hi]

    def batches(self, rank: int, world: int, seed: int) -> Iterator[Batch]:
        if self.config.partition:
            blocks = self.partition_blocks(rank, world, seed)
            return self._block_windows(blocks, make_generator("charlm.partition", seed, rank, world))
        shard = self.shard(rank, world)  # checks rank and shard size now, not at the first next()
        return self.windows(shard, make_generator("charlm.batches", seed, rank, world))

    def block_labels(self) -> np.ndarray:
        """The file index each training block (`seq_len` characters from `k * seq_len`, a
        whole window inside the training split) starts in."""
        train, _ = self.splits()
        blocks = max(0, (len(train) - 1) // self.config.seq_len)
        starts = np.arange(blocks, dtype=np.int64) * self.config.seq_len
        return np.searchsorted(corpus_file_starts(self.config.corpus_chars), starts, side="right") - 1

    def partition_blocks(self, rank: int, world: int, seed: int) -> np.ndarray:
        """The training blocks peer `rank` of `world` owns under `partition`; ValueError if none."""
        check_rank(rank, world)
        # a Dirichlet draw is redrawn until every peer holds a block (Flower's min_partition_size)
        partition = dataclasses.replace(Partition.parse(self.config.partition), min_size=1)
        mine = partition.indices(self.block_labels(), world, seed)[rank]
        if not len(mine):
            raise ValueError(f"partition {self.config.partition} over {world} peers leaves peer {rank} no block of "
                             f"charlm's corpus: raise corpus_chars")
        return mine

    def _block_windows(self, blocks: np.ndarray, generator: torch.Generator) -> Iterator[Batch]:
        train, _ = self.splits()
        offsets = torch.arange(self.config.seq_len + 1)
        starts_of = torch.from_numpy(blocks * self.config.seq_len)
        while True:
            starts = starts_of[torch.randint(len(blocks), (self.config.batch_size,), generator=generator)]
            windows = train[starts[:, None] + offsets].long()
            yield windows[:, :-1], windows[:, 1:]

    def windows(self, tokens: torch.Tensor, generator: torch.Generator) -> Iterator[Batch]:
        """Endless batches of `batch_size` random windows of `tokens` (a shard, or the whole
        training split for IID peers), input and next-character targets."""
        offsets = torch.arange(self.config.seq_len + 1)
        n_starts = len(tokens) - self.config.seq_len
        while True:
            starts = torch.randint(n_starts, (self.config.batch_size,), generator=generator)
            windows = tokens[starts[:, None] + offsets].long()
            yield windows[:, :-1], windows[:, 1:]

    def eval_set(self) -> Batch:
        """Fixed held-out windows, evenly spaced over the held-out split: (n_batches, B, T) each."""
        if self._eval_set is None:
            _, held_out = self.splits()
            cfg = self.config
            if len(held_out) < cfg.seq_len + 1:
                raise ValueError(
                    f"held-out split has {len(held_out)} tokens, fewer than seq_len + 1; "
                    "raise corpus_chars or eval_fraction"
                )
            n_windows = cfg.eval_batches * cfg.batch_size
            starts = torch.linspace(0, len(held_out) - cfg.seq_len - 1, n_windows).long()
            windows = held_out[starts[:, None] + torch.arange(cfg.seq_len + 1)].long()
            windows = windows.view(cfg.eval_batches, cfg.batch_size, cfg.seq_len + 1)
            self._eval_set = (windows[..., :-1], windows[..., 1:])
        return self._eval_set

    # ------------------------------------------------------------------ model, loss, eval

    def make_model(self) -> GPT:
        return GPT.build(self.config.gpt_config(), make_generator("charlm.model", self.config.seed))

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        inputs, targets = self.eval_set()
        with evaluating(model):
            losses = [self.loss(model, to_model_device((x, y), model)).item() for x, y in zip(inputs, targets)]
        eval_loss = sum(losses) / len(losses)
        return {"eval_loss": eval_loss, "eval_bits_per_char": eval_loss / math.log(2)}
