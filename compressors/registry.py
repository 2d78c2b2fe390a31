"""The codecs there are, and the spec strings that name them (how the CLI and configs name a
compressor).

    spec   := stage ("+" stage)*          e.g. "topk:0.01+int8", "fp4:e3m0,block=32"
    stage  := NAME [":" arg ("," arg)*]
    arg    := VALUE | KEY "=" VALUE        positional values fill parameters in order

Every stage but the last must be one that hands a payload on (top-k, random-k, PowerSGD,
sketches). ``from_spec(c.spec)`` rebuilds an equivalent compressor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Compressor

_CODECS: dict[str, type[Compressor]] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make a codec known to specs and to header-driven decoding."""
    if cls.codec in _CODECS:
        raise ValueError(f"codec {cls.codec!r} registered twice")
    for flag in ("stage_lossless", "stage_zero_copy"):
        if not isinstance(getattr(cls, flag, None), bool):
            raise TypeError(f"codec {cls.codec!r} must state {flag} (True or False)")
    if cls.stage_zero_copy and not (cls.stage_lossless and not cls.takes_inner):
        # sending the input's own bytes is lossless, and leaves no payload for a next stage
        raise TypeError(f"codec {cls.codec!r}: a zero-copy stage must be lossless and take no next stage")
    _CODECS[cls.codec] = cls
    return cls


def lookup(name: Any) -> type[Compressor] | None:
    """The codec registered as `name`, or None."""
    return _CODECS.get(name) if isinstance(name, str) else None


def stage_takers() -> list[str]:
    """Names of the codecs that hand a payload on to a next stage, sorted."""
    return sorted(n for n, c in _CODECS.items() if c.takes_inner)


def _parse_stage(text: str, spec: str) -> tuple[str, list[str], dict[str, str]]:
    name, _, args = text.strip().partition(":")
    name = name.strip().lower()
    if not name:
        raise ValueError(f"bad compressor spec {spec!r}: empty stage")
    if name not in _CODECS:
        raise ValueError(
            f"bad compressor spec {spec!r}: unknown codec {name!r} (known: {', '.join(registered_codecs())})"
        )
    positional: list[str] = []
    keyword: dict[str, str] = {}
    if args.strip():
        for item in args.split(","):
            item = item.strip()
            if not item:
                raise ValueError(f"bad compressor spec {spec!r}: empty argument in {text!r}")
            key, eq, value = item.partition("=")
            if eq:
                if key.strip() in keyword:
                    raise ValueError(f"bad compressor spec {spec!r}: {key.strip()!r} given twice")
                keyword[key.strip()] = value.strip()
            elif keyword:
                raise ValueError(f"bad compressor spec {spec!r}: positional {item!r} after key=value")
            else:
                positional.append(item)
    return name, positional, keyword


def from_spec(spec: str) -> Compressor:
    """Build a compressor from a spec such as ``"topk:0.01+int8"``; ValueError if malformed."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"compressor spec must be a non-empty string, got {spec!r}")
    stages = [_parse_stage(part, spec) for part in spec.split("+")]
    inner: Compressor | None = None
    for name, positional, keyword in reversed(stages):
        try:
            inner = _CODECS[name].from_args(positional, keyword, inner)
        except ValueError as exc:
            raise ValueError(f"bad compressor spec {spec!r}: {exc}") from None
    assert inner is not None
    return inner


def registered_codecs() -> tuple[str, ...]:
    """Names usable in specs, sorted."""
    return tuple(sorted(_CODECS))
