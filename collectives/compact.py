"""What a reducer leaves off the wire: what the receiver can rebuild on its own.

A round's messages are small when the vector is (a 27.6K-value DiLoCo fragment in 64/4096 top-k
at 2 bits is 240 bytes a part), and their headers were more than the payload: the packet header
(codec, shape, dtype, k, chunk and the inner stage: about 100 bytes) and the owner's list of
contributors (one peer id of 16 characters per member). Two things shrink them:

- **Packet header templates.** Most codecs write a header that depends only on the spec and
  the length of the vector (int4, q2, sign, chunktopk, none). Both ends compute the header
  that a fresh codec of that spec writes for a vector of zeros of the chunk's length; a packet
  whose header is exactly that template goes with ``"packet": None`` and the receiver puts
  the template back. A header that carries anything else (a scale, a seed) is never equal to
  the template and travels whole. A codec whose template differs between two fresh instances
  (a random seed) gets no template at all.
- **Contributor bitmasks.** An owner answers the members of one group, which all sent the same
  member list; bit k of the mask (byte k // 8, bit k % 8) says whether members[k] contributed.
- **Member lists by digest.** A part names the sender's member list (17 bytes a member: 68 at
  P = 4, 17 KB at P = 1000) by its 16-byte BLAKE2b digest instead. An owner resolves a digest
  against the lists it knows: the ones its own rounds used, the ones members sent it in full,
  and its current view. One it cannot resolve is refused as `unknown_view`, and the sender sends
  that part again with the whole list. 128 bits: finding two lists with one digest is out of
  reach, and a digest, once known, is never pointed at another list.

The receiver checks both like any other field: a None header with no template, a mask of the
wrong length or with bits past the last member are refused as malformed.
"""
from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from starling.compressors import Compressor, from_spec

_TEMPLATES_KEPT = 64  # lengths remembered per codec: a layout has a few; a hostile member list could ask for more
_VIEWS_KEPT = 256  # member lists remembered by digest: membership changes, each a new list
# and at most this many member ids in all: a member may send lists as long as a header allows
# (1 MiB), and 256 of those would hold 256 MiB
_VIEW_IDS_KEPT = 1 << 16
VIEW_DIGEST_BYTES = 16


class HeaderTemplates:
    """The header a codec of `spec` writes for any vector of a given length, where there is one."""

    def __init__(self, codec: Compressor) -> None:
        self.spec = codec.spec
        self._kept: OrderedDict[int, dict[str, Any] | None] = OrderedDict()

    def template(self, numel: int) -> dict[str, Any] | None:
        if numel in self._kept:
            self._kept.move_to_end(numel)
            return self._kept[numel]
        zeros = torch.zeros(numel)
        try:
            first, second = (from_spec(self.spec).encode(zeros).header for _ in range(2))
            found = first if first == second else None
        except Exception:  # a codec that cannot encode zeros alone (needs a seed, a shape): no template
            found = None
        self._kept[numel] = found
        if len(self._kept) > _TEMPLATES_KEPT:
            self._kept.popitem(last=False)
        return found

    def outgoing(self, header: dict[str, Any], numel: int) -> dict[str, Any] | None:
        """What to send for `header`: None where the receiver can rebuild it."""
        return None if header == self.template(numel) else header

    def incoming(self, sent: Any, numel: int) -> Any:
        """The header a message meant: the template for None (ValueError if there is none)."""
        if sent is not None:
            return sent
        found = self.template(numel)
        if found is None:
            raise ValueError(f"packet header left out, but {self.spec} has no header template")
        return found


def contributor_mask(members: Sequence[str], contributors: Sequence[str]) -> bytes:
    """Bit k set where members[k] is among `contributors` (all of which are members)."""
    index = {m: k for k, m in enumerate(members)}
    mask = bytearray((len(members) + 7) // 8)
    for peer in contributors:
        k = index[peer]
        mask[k // 8] |= 1 << (k % 8)
    return bytes(mask)


def contributors_of(members: Sequence[str], mask: Any) -> tuple[str, ...]:
    """The members a mask names, in member order; ValueError for a mask that does not fit.
    Unpacked in C: every member reads the contributors of every average it gets, a thousand
    bits each at 1024 members."""
    if not isinstance(mask, (bytes, bytearray)) or len(mask) != (len(members) + 7) // 8:
        raise ValueError(f"contributor mask must be {(len(members) + 7) // 8} bytes for {len(members)} members")
    if len(members) % 8 and mask[-1] >> (len(members) % 8):
        raise ValueError("contributor mask names members past the last")
    bits = np.unpackbits(np.frombuffer(bytes(mask), dtype=np.uint8), bitorder="little")[:len(members)]
    return tuple(itertools.compress(members, bits.tobytes()))


def view_digest(members: Sequence[str]) -> bytes:
    """The 16-byte name of a sorted member list."""
    return hashlib.blake2b("\n".join(members).encode(), digest_size=VIEW_DIGEST_BYTES).digest()


class KnownViews:
    """Member lists by digest, the newest `_VIEWS_KEPT` of them and `_VIEW_IDS_KEPT` ids at most
    (the newest list always kept); network thread only."""

    def __init__(self) -> None:
        self._lists: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()
        self._ids = 0  # member ids in all the lists kept

    def add(self, members: tuple[str, ...]) -> bytes:
        digest = view_digest(members)
        if digest not in self._lists:
            self._lists[digest] = members
            self._ids += len(members)
        self._lists.move_to_end(digest)
        while len(self._lists) > 1 and (len(self._lists) > _VIEWS_KEPT or self._ids > _VIEW_IDS_KEPT):
            self._ids -= len(self._lists.popitem(last=False)[1])
        return digest

    def resolve(self, digest: Any, current: Callable[[], tuple[str, ...]]) -> tuple[str, ...] | None:
        """The member list a part names by digest: one known here, else the `current` view if
        that is it (then known from now on); None if neither. ValueError for what is no digest."""
        if not isinstance(digest, bytes) or len(digest) != VIEW_DIGEST_BYTES:
            raise ValueError(f"view must be a {VIEW_DIGEST_BYTES}-byte digest")
        known = self._lists.get(digest)
        if known is not None:
            return known
        view = current()
        if view_digest(view) != digest:
            return None
        self.add(view)
        return view
