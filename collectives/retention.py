"""Signed parts an owner keeps past their groups' close, for audits (`protocols/audit.py`):
the round engine's retention defence (`RoundDefence`).

    reducer.keep(t, authors)    # caller's thread, before round t starts
    ... round t runs; each group that closes keeps the named authors' signed parts ...
    reducer.take_kept(t)        # caller's thread, after round t's wait(): decoded, then forgotten

Only the last `KEEP_ROUNDS` rounds asked for are kept: an audit that never takes its parts
loses nothing, and memory stays bounded whatever the rounds. Once taken, a round's parts stay
`SHOW_ROUNDS` rounds more for other members that gather an author's parts from every owner
(`shown(t, author)`: DiLoCo's checks of a whole pseudo-gradient, `protocols/verification.py`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from starling.collectives.contributions import SignedPart
from starling.collectives.defences import RoundDefence
from starling.compressors import decode

if TYPE_CHECKING:
    from starling.collectives.accumulator import ShardGroup, Verdict

log = logging.getLogger(__name__)

KEEP_ROUNDS = 4  # rounds whose parts are held for `take` (rounds asked for and never taken go)
SHOW_ROUNDS = 2  # rounds whose taken parts are still shown to members that gather them
_Kept = tuple[int, int, int, int, SignedPart]  # (shard, chunk, lo, hi, part)


@dataclass(frozen=True)
class KeptPart:
    """A remote author's signed part of one chunk, kept past its group's close: its values as
    the owner summed them, and the signed form as part evidence carries it."""

    shard: int
    chunk: int
    lo: int
    hi: int
    values: torch.Tensor
    detail: dict[str, Any]  # topic, shard, chunk, view, weight, content, sig, recipe?, header, buffers


class Retention(RoundDefence):
    """One reducer's kept parts (its topic). `ask` runs on the caller's thread and only
    replaces a frozen map; the rest runs on the network thread."""

    def __init__(self, me: str, topic: str) -> None:
        self.me, self.topic = me, topic
        # round -> authors whose signed parts my groups keep past their close (frozen: set by the
        # caller's thread, read by the network thread), and what they kept (network thread)
        self._keeping: dict[int, frozenset[str]] = {}
        self._kept: dict[int, dict[str, list[_Kept]]] = {}
        self._shown: dict[int, dict[str, list[_Kept]]] = {}  # taken, still shown to members that gather them

    @property
    def holding(self) -> bool:
        """Whether any round's parts are asked for or held."""
        return bool(self._keeping or self._kept)

    def ask(self, t: int, authors: frozenset[str] | set[str]) -> None:
        self._keeping = {r: a for r, a in self._keeping.items() if r > t - KEEP_ROUNDS} | {t: frozenset(authors)}

    def on_close(self, t: int, i: int, c: int, bounds: tuple[int, int], group: ShardGroup, verdict: Verdict,
                 avg: torch.Tensor) -> None:
        for old in [r for r in self._kept if r not in self._keeping]:  # asked for, then never taken
            del self._kept[old]
        authors = self._keeping.get(t)
        if not authors:
            return
        kept = self._kept.setdefault(t, {})
        for author in authors & group.signed.keys():
            kept.setdefault(author, []).append((i, c, *bounds, group.signed[author].kept()))

    def take(self, t: int) -> dict[str, list[_Kept]]:
        """Network thread (a group closing meanwhile would drop round t's parts): round t's kept
        parts, forgotten here."""
        self._keeping = {r: a for r, a in self._keeping.items() if r != t}
        kept = self._kept.pop(t, {})
        for old in [r for r in self._kept if r <= t - KEEP_ROUNDS]:  # rounds asked for and never taken
            del self._kept[old]
        self._shown[t] = kept
        for old in [r for r in self._shown if r <= t - SHOW_ROUNDS]:
            del self._shown[old]
        return kept

    def shown(self, t: int, author: str) -> list[_Kept]:
        """Network thread: `author`'s parts of round t that my groups kept, taken or not."""
        return list(self._kept.get(t, {}).get(author, ())) or list(self._shown.get(t, {}).get(author, ()))

    def decoded(self, t: int, kept: dict[str, list[_Kept]]) -> dict[str, list[KeptPart]]:
        """Caller's thread: each author's parts of round t, chunk by chunk, decoded."""
        out: dict[str, list[KeptPart]] = {}
        for author, parts in kept.items():
            for i, c, lo, hi, signed in sorted(parts, key=lambda p: p[2]):
                if signed.packet is None:
                    continue
                try:
                    values = decode(signed.packet).reshape(-1)
                except Exception as exc:  # the owner summed it once; whatever fails now proves nothing
                    log.warning("%s: %s's kept part of round %d does not decode: %s", self.me, author, t, exc)
                    continue
                detail = {**signed.detail(self.topic, i, c), "header": signed.packet.header,
                          "buffers": [bytes(b.numpy()) for b in signed.packet.buffers]}
                out.setdefault(author, []).append(KeptPart(i, c, lo, hi, values, detail))
        return out
