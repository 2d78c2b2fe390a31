"""Whether every member of a round holds the same bits of some state (DiLoCo's outer
parameters), without anyone sending the state.

Each member hashes its tensors and takes the first WIDTH bytes of the digest as small
integers c, one per half byte (0 to 15). It sends [c, c^2] through a tiny lossless all-reduce.
The round's mean equals a member's own [c, c^2] exactly when every member's c are the same:
mean(c^2) = mean(c)^2 only when c does not vary. Every member gets the same mean, so every
member reaches the same verdict in the same round: there is no heartbeat to wait for and no
view to disagree on.

"Exactly" holds while the owner's float32 sums are exact: integers up to 2^24. Half bytes keep
c^2 at most 225, so up to MAX_MEMBERS members; whole bytes (c^2 up to 65,025) would pass it at
259 members, and every check of a larger swarm would find a difference where there is none.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from starling.collectives.reduce import ReduceTimeouts, ShardedReducer
from starling.common.hashing import tensor_digest

if TYPE_CHECKING:
    from starling.node import Node

WIDTH = 8  # digest bytes compared: a false "agree" needs a 2^-64 collision
MAX_MEMBERS = (1 << 24) // 225  # members whose sums of c^2 stay exact in float32 (74,565)


def digest_bytes(tensors: Sequence[torch.Tensor], width: int = WIDTH) -> bytes:
    """The first `width` bytes (at most 32) of the sha256 of the tensors' bits, in order."""
    return tensor_digest(tensors).digest()[:width]


def sampled_digest(tensors: Sequence[torch.Tensor], width: int, values: int = 1 << 16) -> bytes:
    """`digest_bytes` of about `values` values, strided evenly over all the tensors: cheap
    enough to take every round, and it covers every region of the state (two states that
    differ in one chunk of an all-reduce, or everywhere, almost surely differ in it)."""
    total = sum(t.numel() for t in tensors)
    stride = max(1, total // values)
    return digest_bytes([t.detach().reshape(-1)[::stride] for t in tensors], width)


def agreement_values(digest: bytes) -> torch.Tensor:
    """What a member sends: [c, c^2] for c each half byte of `digest`, as float32."""
    c = torch.tensor([v for b in digest for v in (b >> 4, b & 15)], dtype=torch.float32)
    return torch.cat([c, c * c])


class AgreementCheck:
    """Asks, in round t, whether every member's tensors are bit for bit the same."""

    def __init__(self, node: Node, topic: str, timeouts: ReduceTimeouts, is_open: Callable[[], bool]) -> None:
        # One owner: 16 values cut into a shard per member made n^2 requests of a value or
        # none each (65,536 at 256 peers, which did not finish in the round timeout).
        self.reducer = ShardedReducer(node, topic, 4 * WIDTH, "none", timeouts, is_open, min_shard_numel=4 * WIDTH,
                                      max_owners=1)

    def agree(self, t: int, members: tuple[str, ...], tensors: Sequence[torch.Tensor]) -> bool | None:
        """True if every member holds the same bits, False if some member differs, None when
        the round went on without a member, or has more than MAX_MEMBERS (no verdict)."""
        if len(members) > MAX_MEMBERS:  # its sums would not be exact: no verdict, on every member alike
            return None
        mine = agreement_values(digest_bytes(tensors))
        vector = mine.clone()
        result = self.reducer.reduce(t, members, vector)
        if result.lost or result.peers < len(members):
            return None
        return torch.equal(vector, mine)
