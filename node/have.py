"""The peers a table pull's asker holds, named by their ids' first characters: built, read and
matched as arrays, not one id at a time.

A member that pulls a table (`$sync`, `node/table_sync.py`) names each peer it holds alive by
the first HAVE_CHARS characters of its id, so that the helper's pages leave them out. While a
swarm forms, every member pulls about once a second and holds most of the swarm, so each pull
names nearly every peer. Building that list from the ids, reading it back into a set, and
testing each of the helper's ids against it, one id at a time in Python, took about a tenth of
a simulated worker's profile samples while 1024 peers formed.

Here each prefix is one integer: its HAVE_CHARS ASCII characters as big-endian bytes (48 bits).
A table keeps its live ids' codes beside their sorted order (`IdSet(code=prefix_code)`), so the
asker's list is one array encoded at once (`encode_codes`), and the helper reads a list into a
sorted array (`Have.parse`) and finds the ids it lacks with one vectorized binary search.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

HAVE_CHARS = 6  # characters of an id that name it: 30 bits of its key's hash (base32)
_BITS = 8  # a character, as a byte
_SHIFTS = np.arange(HAVE_CHARS - 1, -1, -1, dtype=np.int64) * _BITS
NO_CODE = -1  # the code of an id that no list can name (too short, or not ASCII)


def prefix_code(peer_id: str) -> int:
    """The integer a list names `peer_id` by: its first HAVE_CHARS characters as big-endian
    bytes; NO_CODE for an id too short or not ASCII there (which no list's entry matches, as
    no HAVE_CHARS-character prefix equals it)."""
    if len(peer_id) < HAVE_CHARS:
        return NO_CODE
    try:
        return int.from_bytes(peer_id[:HAVE_CHARS].encode("ascii"), "big")
    except UnicodeEncodeError:
        return NO_CODE


def encode_codes(codes: np.ndarray) -> bytes:
    """The list that names these codes on the wire: HAVE_CHARS ASCII bytes each (NO_CODE ones
    left out)."""
    held = codes[codes >= 0]
    chars = (held[:, None] >> _SHIFTS) & ((1 << _BITS) - 1)
    return chars.astype(np.uint8).tobytes()


class HaveError(ValueError):
    """A list that is not whole HAVE_CHARS-byte ASCII prefixes."""


class Have:
    """A pull's list of held peers, read: `codes`, one per entry, sorted."""

    __slots__ = ("codes",)

    def __init__(self, codes: np.ndarray) -> None:
        self.codes = np.sort(codes)

    @classmethod
    def parse(cls, raw: bytes, max_entries: int) -> Have:
        """Read a list off the wire; HaveError if it is not whole ASCII prefixes, or longer
        than `max_entries` of them."""
        if len(raw) % HAVE_CHARS or len(raw) > HAVE_CHARS * max_entries:
            raise HaveError(f"at most {max_entries} {HAVE_CHARS}-byte id prefixes")
        chars = np.frombuffer(raw, dtype=np.uint8)
        if chars.size and int(chars.max()) >= 128:
            raise HaveError("ASCII id prefixes")
        return cls((chars.reshape(-1, HAVE_CHARS).astype(np.int64) << _SHIFTS).sum(axis=1))

    @classmethod
    def of(cls, peer_ids: Sequence[str]) -> Have:
        """The list a holder of `peer_ids` sends, read back (tests, benchmarks)."""
        codes = np.fromiter((prefix_code(p) for p in peer_ids), dtype=np.int64, count=len(peer_ids))
        return cls.parse(encode_codes(codes), max(len(peer_ids), 1))

    def __len__(self) -> int:
        return int(self.codes.size)

    def __bool__(self) -> bool:
        return bool(self.codes.size)

    def _named(self, codes: np.ndarray) -> np.ndarray:
        """For each code, whether this list names it: a binary search of the sorted list each
        (`numpy.isin` sorts both sides, five times as long at a thousand peers)."""
        if not self.codes.size:
            return np.zeros(codes.shape, dtype=bool)
        at = np.searchsorted(self.codes, codes)
        at[at == self.codes.size] = 0  # past the end: compared with any entry, it differs
        return self.codes[at] == codes  # type: ignore[no-any-return]

    def lacking(self, codes: np.ndarray) -> np.ndarray:
        """The positions in `codes` (a table's ids' codes), in order, of the ids this list does
        not name."""
        return np.flatnonzero(~self._named(codes))

    def names(self, peer_ids: Sequence[str]) -> list[bool]:
        """For each id, whether this list names it."""
        codes = np.fromiter((prefix_code(p) for p in peer_ids), dtype=np.int64, count=len(peer_ids))
        return self._named(codes).tolist()  # type: ignore[no-any-return]
