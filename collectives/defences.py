"""What a sharded all-reduce does against members it cannot trust, as one config, and the
owner's watch on members whose parts it keeps leaving out.

    Defences(aggregator="centered_clip", owner_replication=3, max_weight=W)

- `aggregator`: how an owner combines a chunk's parts (`collectives/aggregators/`): the plain
  mean, or a robust one, after screening out parts whose norm is far from the round's median.
- `owner_replication`: how many owners each shard has, placed afresh each round. Members send
  each part to all of them and compare the signed averages by digest: with three, the
  majority wins, and an owner outvoted with the same contributors in `accuse_after` of its
  rounds in a row is accused; with two, a disagreement drops the shard for the round. Parts
  cost that many times the bytes.
- `max_weight`: the most weight (tokens) a part may claim: the round's step budget times
  the batch's tokens, which the protocol knows. A part over it is refused, and its signature
  is evidence that bans its author.
- `check_rate`: with one owner per shard, the share of a round's chunks that members check
  after the round (`collectives/checking.py`): a member drawn from its own randomness asks the
  owner for the chunk's signed parts and averages them again; an answer that the parts do not
  give is evidence that bans the owner. Costs about `check_rate` of the vector a round in bytes.
- `accuse_after`: an owner accuses a member, as one witness, once its parts were screened
  out of that owner's groups in this many of its contributions in a row. Two witnesses ban
  (`node.trust`), so one owner cannot ban a member alone. Parts pointing against the robust
  average (cosine below `-opposed_cos`) are only counted; `suspicion` judges direction, against
  each chunk's median, across owners and rounds (`collectives/suspicion.py`).

Every peer of a swarm must use the same defences: the owners' averages are the swarm's.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starling.collectives.aggregators import AggregatorConfig
from starling.collectives.suspicion import SuspicionConfig

if TYPE_CHECKING:
    import torch

    from starling.collectives.accumulator import ShardGroup, Verdict
    from starling.collectives.contributions import SignedPart
    from starling.collectives.outcome import ShardResult
    from starling.compressors import Packet

OUTLIER = "part.outlier"  # witness evidence: parts screened out round after round


@dataclass(frozen=True)
class Defences:
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)
    owner_replication: int = 1
    max_weight: float | None = None
    accuse_after: int = 3
    opposed_cos: float = 0.0
    suspicion: SuspicionConfig = field(default_factory=SuspicionConfig)
    check_rate: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.aggregator, str):
            object.__setattr__(self, "aggregator", AggregatorConfig.parse(self.aggregator))
        if self.owner_replication not in (1, 2, 3):
            raise ValueError(f"owner_replication must be 1, 2 or 3, got {self.owner_replication!r}")
        if not 0.0 <= self.check_rate <= 1.0:
            raise ValueError(f"check_rate must be in [0, 1], got {self.check_rate!r}")
        if self.accuse_after < 1:
            raise ValueError(f"accuse_after must be >= 1, got {self.accuse_after!r}")

    @property
    def on(self) -> bool:
        """Whether any defence is on. Off (the plain mean, one owner, no cap), owners still
        check signatures and leave non-finite parts out, but accuse nobody: a swarm that did
        not ask for defences is not one that bans a peer for a bf16 overflow."""
        return (self.aggregator.robust or self.owner_replication > 1 or self.max_weight is not None
                or self.check_rate > 0.0)

    @property
    def fixed_answers(self) -> bool:
        """Whether an owner's average must be a function of its parts alone, which another
        peer can compute again: replicated owners compare theirs, checkers recompute them. Such
        owners start CenteredClip from the median and send averages without error feedback."""
        return self.owner_replication > 1 or self.check_rate > 0.0


class OutlierWatch:
    """An owner's record of each member's recent contributions to its groups: screened out
    or not, per round. Network thread only; bounded by `max_peers` members."""

    def __init__(self, accuse_after: int, max_peers: int = 4096) -> None:
        self.accuse_after, self.max_peers = accuse_after, max_peers
        self._recent: dict[str, deque[tuple[int, bool]]] = {}

    def saw(self, peer: str, t: int, screened: bool) -> bool:
        """Record `peer`'s contribution of round t; True when it should be accused now: its
        last `accuse_after` rounds were all screened out (once per round)."""
        recent = self._recent.get(peer)
        if recent is None:
            if len(self._recent) >= self.max_peers:
                self._recent.pop(next(iter(self._recent)))
            recent = self._recent[peer] = deque(maxlen=self.accuse_after)
        if recent and recent[-1][0] == t:  # another chunk of the same round: screened if any chunk was
            if screened and not recent[-1][1]:
                recent[-1] = (t, True)
                return self._full(recent)
            return False
        recent.append((t, screened))
        return self._full(recent)

    def _full(self, recent: deque[tuple[int, bool]]) -> bool:
        return len(recent) == self.accuse_after and all(s for _, s in recent)


class ReplayWatch:
    """An owner's memory of the content digests of each member's recent parts, to catch a
    member that sends a part of an earlier round again as new (re-signed by itself, so the
    signature alone cannot tell). Network thread only; `keep` digests per member, at most
    `max_peers` members."""

    def __init__(self, keep: int = 256, max_peers: int = 4096) -> None:
        self.keep, self.max_peers = keep, max_peers
        self._seen: dict[str, dict[bytes, tuple[int, Any]]] = {}

    def seen(self, peer: str, t: int, content: bytes, record: Any) -> tuple[int, Any] | None:
        """The (round, record) of `peer`'s earlier part with this content, from another round;
        else None, and this one is remembered with `record`."""
        seen = self._seen.get(peer)
        if seen is None:
            if len(self._seen) >= self.max_peers:
                self._seen.pop(next(iter(self._seen)))
            seen = self._seen[peer] = {}
        earlier = seen.get(content)
        if earlier is not None and earlier[0] != t:
            if earlier[0] < t:  # the latest round it came in: a repeat round after round stays a repeat
                seen[content] = (t, record)
            return earlier
        if earlier is None:
            seen[content] = (t, record)
            while len(seen) > self.keep:
                seen.pop(next(iter(seen)))
        return None


class RoundDefence:
    """A seam of the round engine (`collectives/reduce.py`): what one defence sees of a round.
    The engine calls every defence it holds, in order, and each hook is a no-op by default.

    - `on_part`, on the owner, for a part whose signature verified, before it joins its group:
      a refusal body turns the part away (counted, evidence already taken), None lets it in;
    - `on_close`, on the owner, once a group is averaged and before its answer is signed: the
      parts it kept (`group.received`, `group.signed`), the aggregator's verdict, the average;
    - `on_chosen`, on a member, with the answer it took for each chunk it sent.

    Network thread only."""

    def on_part(self, sender: str, t: int, i: int, c: int, signed: SignedPart, packet: Packet
                ) -> dict[str, Any] | None:
        return None

    def on_close(self, t: int, i: int, c: int, bounds: tuple[int, int], group: ShardGroup, verdict: Verdict,
                 avg: torch.Tensor) -> None:
        return None

    def on_chosen(self, t: int, bounds: tuple[int, int], owners: tuple[str, ...], chosen: ShardResult) -> None:
        return None
