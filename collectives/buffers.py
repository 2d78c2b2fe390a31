"""A model's buffers at a sync: floating ones (BatchNorm's running mean and variance) averaged
over a round's members, integer ones (`num_batches_tracked`) set to their maximum, so that
after a sync every peer evaluates with the same statistics and the same counts.

Both travel losslessly through sharded all-reduces of their own (buffers are small next to the
parameters); owners sum in member order, so every member holds the same bits. A chunk whose
owner died keeps its local values, as the parameters' chunks do.

The maximum on an all-reduce that only averages float32 vectors: each member writes its
integers into its own slot of a vector of SLOTS slots, zeros elsewhere, each int64 cut into
four 16-bit pieces. An owner's sum then holds every member's pieces exactly (a piece plus
zeros), and its mean divides each by the member count P; P times that mean is the piece
again, off by less than 2^16 * 2^-23 in float32, so rounding recovers it. Every member thus
reads every member's integers and takes the same maximum. A round of more than SLOTS members
takes ceil(P / SLOTS) of these rounds, one after another. The divisor is known only when every
member's part reached every owner: after a round that went on without someone, the integers
stay each peer's own until the next sync (the floating buffers are averaged all the same).
Complex buffers are neither, and stay each peer's own.

Only persistent buffers (those in the model's `state_dict`) are exchanged. A non-persistent
one (an attention mask, position ids, a rotary cache) is a constant the model derives from its
config: the same on every peer, and never learned. A Hugging Face GPT-2's `position_ids`
would otherwise cost 256 bytes per position per sync, for nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from starling.collectives.reduce import ReduceResult, ReduceTimeouts, ShardedReducer

if TYPE_CHECKING:
    from starling.node import Node

log = logging.getLogger(__name__)

SLOTS = 16  # members whose integers one round of the maximum carries
PIECE_BITS, PIECES = 16, 4  # an int64 as four pieces, each exact in float32 through a mean
_SUBROUNDS = 1 << 10  # the maximum's rounds of sync t are t * _SUBROUNDS + j: up to 16384 members


class ModelBuffers:
    """`model`'s buffers as protocols exchange them: the floating ones as one float32 vector,
    the integer ones (bool included) as one int64 vector, each on the buffers' own device."""

    def __init__(self, model: nn.Module) -> None:
        persistent = {id(t) for t in model.state_dict(keep_vars=True).values()}
        buffers = [b for b in model.buffers() if id(b) in persistent]
        self.floats = [b for b in buffers if b.is_floating_point()]
        self.ints = [b for b in buffers if not (b.is_floating_point() or b.is_complex())]
        self.float_numel = sum(b.numel() for b in self.floats)
        self.int_numel = sum(b.numel() for b in self.ints)

    def read_floats(self) -> torch.Tensor:
        return _cat(self.floats, torch.float32)

    def read_ints(self) -> torch.Tensor:
        return _cat(self.ints, torch.int64)

    def write_floats(self, vector: torch.Tensor) -> None:
        _write(self.floats, vector)

    def write_ints(self, vector: torch.Tensor) -> None:
        _write(self.ints, vector)

    @torch.no_grad()
    def add_to_floats(self, delta: torch.Tensor) -> None:
        for b, chunk in zip(self.floats, torch.split(delta, [b.numel() for b in self.floats])):
            b.add_(chunk.view_as(b).to(b.device, b.dtype))

    def max_ints(self, theirs: torch.Tensor) -> None:
        """Each integer becomes the larger of mine and `theirs`."""
        mine = self.read_ints()
        self.write_ints(torch.maximum(mine, theirs.to(mine.device)))


class BufferAverager:
    """At a sync, averages `model`'s floating buffers and takes the maximum of its integer
    ones, under `topic` and `topic`.max; `averaged` and `maxed` are what the last sync left."""

    def __init__(self, node: Node, model: nn.Module, topic: str, timeouts: ReduceTimeouts,
                 is_open: Callable[[], bool], max_owners: int = 0, min_shard_numel: int = 1) -> None:
        """`max_owners`: the most owners a round has (the protocol's, so that its rounds fit the
        sockets a node holds as the protocol's own rounds do); 0: one per member.
        `min_shard_numel`: the fewest values a shard holds (the protocol's too)."""
        self.node = node
        self.buffers = ModelBuffers(model)
        self.numel = self.buffers.float_numel
        self.reducer = ShardedReducer(node, topic, self.numel, "none", timeouts, is_open,
                                      max_owners=max_owners, min_shard_numel=min_shard_numel) if self.numel else None
        n = self.buffers.int_numel
        self.max_reducer = ShardedReducer(node, f"{topic}.max", SLOTS * n * PIECES, "none", timeouts, is_open,
                                          max_owners=max_owners, min_shard_numel=min_shard_numel) if n else None
        self.reducers = [r for r in (self.reducer, self.max_reducer) if r is not None]  # for peer events
        self.averaged: torch.Tensor | None = None  # what every member of the last sync holds
        self.maxed: torch.Tensor | None = None

    def sync(self, t: int, members: tuple[str, ...]) -> ReduceResult | None:
        """Round t over `members` (blocking): the floating buffers' average and the integer
        buffers' maximum, written into the model. Returns the floating round's outcome."""
        pending = None
        if self.reducer is not None:
            vector = self.buffers.read_floats()
            pending = self.reducer.start(t, members, vector, lend=True)  # in flight while the maximum runs
        if self.max_reducer is not None:
            self._take_max(t, members)
        if pending is None:
            return None
        result = pending.wait()
        self.buffers.write_floats(vector)
        self.averaged = vector
        return result

    def skip(self, t: int, members: tuple[str, ...]) -> None:
        """This peer takes no part in sync t (see `ShardedReducer.skip`): nobody waits for it there."""
        if self.reducer is not None:
            self.reducer.skip(t)
        if self.max_reducer is not None:
            for j in range(-(-len(members) // SLOTS)):
                self.max_reducer.skip(t * _SUBROUNDS + j)

    def _take_max(self, t: int, members: tuple[str, ...]) -> None:
        assert self.max_reducer is not None
        if self.node.peer_id not in members:
            return
        me, count = members.index(self.node.peer_id), len(members)
        mine = _split(self.buffers.read_ints())  # (n, PIECES)
        values = []
        for j, first in enumerate(range(0, count, SLOTS)):
            vector = torch.zeros(SLOTS, *mine.shape, device=mine.device)
            if first <= me < first + SLOTS:
                vector[me - first] = mine
            result = self.max_reducer.reduce(t * _SUBROUNDS + j, members, vector.view(-1))
            if result.lost or result.peers < count:
                log.info("%s: %s round %d went on without %s; integer buffers stay mine until the next sync",
                         self.node.peer_id, self.max_reducer.topic, t, list(result.lost))
                return
            values.append(_join(vector[:min(SLOTS, count - first)] * count))
        maxed = torch.cat(values).amax(dim=0)
        self.buffers.write_ints(maxed)
        self.maxed = maxed

    def write_averaged(self, model: nn.Module) -> None:
        """Put what the last sync left (the floats' average, the integers' maximum) into
        `model`'s buffers (a twin of the synced model)."""
        twin = ModelBuffers(model)
        if self.averaged is not None:
            twin.write_floats(self.averaged)
        if self.maxed is not None:
            twin.write_ints(self.maxed)

    def state_dict(self) -> dict[str, Any]:
        return {"averaged": None if self.averaged is None else self.averaged.clone(),
                "maxed": None if self.maxed is None else self.maxed.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        averaged, maxed = state.get("averaged"), state.get("maxed")
        if averaged is not None and averaged.numel() != self.numel:
            raise ValueError(f"averaged buffers of {averaged.numel()} values, this model's have {self.numel}")
        if maxed is not None and maxed.numel() != self.buffers.int_numel:
            raise ValueError(f"integer buffers of {maxed.numel()} values, this model's have "
                             f"{self.buffers.int_numel}")
        self.averaged = None if averaged is None else averaged.to(torch.float32).clone()
        self.maxed = None if maxed is None else maxed.to(torch.int64).clone()


def _split(ints: torch.Tensor) -> torch.Tensor:
    """int64 (n,) -> float32 (n, PIECES): the two's-complement bits, 16 at a time, low first."""
    mask = (1 << PIECE_BITS) - 1
    return torch.stack([(ints >> (PIECE_BITS * k)) & mask for k in range(PIECES)], dim=-1).to(torch.float32)


def _join(pieces: torch.Tensor) -> torch.Tensor:
    """The inverse of `_split` for pieces off by less than 1/2: (..., n, PIECES) -> int64 (..., n)."""
    p = pieces.round().to(torch.int64)
    top = p[..., -1]
    value = top - (top >= 1 << (PIECE_BITS - 1)).to(torch.int64) * (1 << PIECE_BITS)  # the sign lives here
    for k in range(PIECES - 2, -1, -1):
        value = value * (1 << PIECE_BITS) + p[..., k]
    return value


def _cat(buffers: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not buffers:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([b.detach().reshape(-1).to(dtype) for b in buffers])


@torch.no_grad()
def _write(buffers: list[torch.Tensor], vector: torch.Tensor) -> None:
    for b, chunk in zip(buffers, torch.split(vector, [b.numel() for b in buffers])):
        b.copy_(chunk.view_as(b).to(b.device, b.dtype))
