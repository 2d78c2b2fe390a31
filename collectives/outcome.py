"""What a round of the sharded all-reduce is given (its timeouts) and what it returns (its
outcome, and each owner's answer on the way): small types that the round engine, its seams
and what averages with it share."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starling.compressors import Packet


@dataclass(frozen=True)
class ReduceTimeouts:
    round_timeout_s: float = 30.0  # an owner closes a shard without members not in by then
    reply_grace_s: float = 2.0  # a member waits round_timeout_s + this for an owner's average
    retry_interval_s: float = 0.05  # re-send a part to an owner whose protocol is not up yet


@dataclass(frozen=True)
class ReduceResult:
    """What one round did to the caller's vector (averaged in place where owners answered)."""

    round: int
    synced: bool  # some shard was averaged with at least one other peer
    peers: int  # members whose contribution every shard's average includes (self included)
    lost: tuple[str, ...]  # members missing from some shard's average
    ahead: int  # the latest round an owner said it is in (> round: this peer fell behind)
    skipped: tuple[str, ...] = ()  # members missing from it that said they send nothing in it (not lost)
    # each contributor's share of the average, when their weights differed (sum to one); () when equal
    shares: tuple[tuple[str, float], ...] = ()
    # members missing from every shard's average that came back: nothing of theirs counted (a
    # joiner still fetching state, a peer that died unnoticed); this peer too, when its own parts
    # are in none (or its round was late); () when no average came back
    absent: tuple[str, ...] = ()
    # an owner saw the members begin this round with different states (their parts' digests
    # differed): every member that got such an average checks and repairs them after the round
    diverged: bool = False
    # every chunk came back averaged, each average counting every member (this peer too): the
    # members all applied the same averages to whatever state they began the round with
    whole: bool = False


def shares_in(reply: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    """The contributors' shares an owner's reply names (none when their weights were equal)."""
    return tuple(sorted((str(peer), float(share)) for peer, share in reply.get("shares") or ()))


@dataclass(frozen=True)
class ShardResult:
    """What one owner answered a member for one chunk of a round (or why it did not)."""

    shard: int
    chunk: int
    owner: str
    packet: Packet | None  # the averaged chunk; None: no average (the round's rule decides the chunk)
    contributors: tuple[str, ...] = ()
    reason: str = ""
    owner_round: int = -1  # the owner's latest round, when it refused a part as late
    shares: tuple[tuple[str, float], ...] = ()
    content: bytes | None = None  # the average's digest, for a vote among replicated owners
    sig: bytes | None = None  # the owner's signature of it
    diverged: bool = False  # the owner saw its contributors begin the round with different states
    scores: tuple[float, tuple[tuple[float, float], ...]] | None = None  # against the reference (suspicion.py)
    silent: bool = False  # the owner never answered (timeout, dead or unknown owner): others may have heard it
