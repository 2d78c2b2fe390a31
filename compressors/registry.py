"""Spec strings: how the CLI and configs name a compressor.

    spec   := stage ("+" stage)*          e.g. "topk:0.01+int8", "fp4:e3m0,block=32"
    stage  := NAME [":" arg ("," arg)*]
    arg    := VALUE | KEY "=" VALUE        positional values fill parameters in order

Every stage but the last must be one that hands a payload on (top-k, random-k, PowerSGD,
sketches). ``from_spec(c.spec)`` rebuilds an equivalent compressor.
"""
from __future__ import annotations

from .base import _CODECS, Compressor


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
