"""What the collectives' bodies share: `BodyError`, and the checks of the fields several
families of bodies carry (round and shard numbers, weights, member lists, packet headers,
signatures, recipes, state digests, views). Each check raises `BodyError` naming what is wrong.
"""
from __future__ import annotations

import math
from typing import Any

from starling.collectives.compact import VIEW_DIGEST_BYTES

STATE_DIGEST_BYTES = 8  # a part's digest of the state its author began the round with

SIGNATURE_BYTES = 64  # Ed25519


class BodyError(ValueError):
    """A body that is not what its topic takes; the message names what is wrong."""


def _map(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BodyError(f"{what} must be a map, got {type(obj).__name__}")
    return obj


def _whole(obj: dict[str, Any], key: str) -> int:
    value = obj.get(key)
    if type(value) is not int or value < 0:
        raise BodyError(f"{key} must be a whole number >= 0, got {value!r}")
    return value


def _weight(value: Any) -> float:
    if type(value) not in (int, float) or not (math.isfinite(value) and value >= 0.0):
        raise BodyError(f"weight must be a finite number >= 0, got {value!r}")
    return float(value)


def _members(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise BodyError("members must be a list of peer ids")
    if value != sorted(set(value)):
        raise BodyError("members must be sorted and unique")
    return tuple(value)


MAX_DEAL_BYTES = 256  # a sealed share: 66 bytes of field element, a 64-byte signature, a 16-byte tag


def _deal(value: Any) -> tuple[int, bytes] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and type(value[0]) is int and value[0] > 0
            and isinstance(value[1], bytes) and len(value[1]) <= MAX_DEAL_BYTES):
        raise BodyError(f"deal must be [point > 0, sealed share of at most {MAX_DEAL_BYTES} bytes]")
    return value[0], value[1]


def _state(value: Any) -> bytes | None:
    if value is not None and not (isinstance(value, bytes) and len(value) == STATE_DIGEST_BYTES):
        raise BodyError(f"state must be a {STATE_DIGEST_BYTES}-byte digest")
    return value


def _header(obj: dict[str, Any]) -> dict[str, Any] | None:
    if "packet" not in obj:
        raise BodyError("packet header missing (None where the receiver rebuilds it)")
    header = obj["packet"]
    if header is not None and not isinstance(header, dict):
        raise BodyError(f"packet header must be a map or None, got {type(header).__name__}")
    return header


def _sig(obj: dict[str, Any]) -> bytes | None:
    sig = obj.get("sig")
    if sig is not None and (not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES):
        raise BodyError(f"sig must be {SIGNATURE_BYTES} bytes, got {type(sig).__name__}")
    return sig


MAX_RECIPE_FIELDS = 8
MAX_RECIPE_BYTES = 64


def _recipe(value: Any) -> tuple[int | bytes, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_RECIPE_FIELDS:
        raise BodyError(f"recipe must be a list of at most {MAX_RECIPE_FIELDS} fields")
    for field_ in value:
        if not ((type(field_) is int and -(1 << 63) <= field_ < (1 << 63))
                or (isinstance(field_, bytes) and len(field_) <= MAX_RECIPE_BYTES)):
            raise BodyError(f"recipe fields must be 64-bit integers or at most {MAX_RECIPE_BYTES} bytes, "
                            f"got {field_!r:.40}")
    return tuple(value)


def _pairs(value: Any, what: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, list):
        raise BodyError(f"{what} must be a list of [peer, number]")
    pairs = []
    for entry in value:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
                and type(entry[1]) in (int, float) and math.isfinite(entry[1]) and entry[1] >= 0.0):
            raise BodyError(f"{what}: bad entry {entry!r}, expected [peer, number >= 0]")
        pairs.append((entry[0], float(entry[1])))
    return tuple(pairs)


MAX_PART_BUFFERS = 8  # a packet has one to three buffers
MAX_IDS = 1 << 16  # peer ids one body may name (secure aggregation's, a check's or a gather's answer)


def _view(obj: dict[str, Any]) -> bytes:
    view = obj.get("view")
    if not isinstance(view, bytes) or len(view) != VIEW_DIGEST_BYTES:
        raise BodyError(f"view must be a {VIEW_DIGEST_BYTES}-byte digest")
    return view
