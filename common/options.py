"""Options into frozen config dataclasses: the one parser and coercer.

Protocols, tasks and the CLI take options the same way. A name is a field of the config,
and ``sync-every`` is ``sync_every`` (the CLI spells flags with dashes). A value is either
typed already (Python callers, a swarm config off the wire) or text as a user typed it
(``--opt sync_every=20``); text is read as the field's type, typed values must already be
of it. Every bad name or value raises one clear line naming the field.

Each caller keeps the exception type its users catch: protocols pass ``error=ProtocolError``,
tasks take the default ValueError.

    config = config_from_options(GossipConfig, parse_options(["fanout=2", "lr=0.1"]))
"""
from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def option_name(name: str) -> str:
    """The field an option names: surrounding blanks dropped, dashes read as underscores."""
    return name.strip().replace("-", "_")


def parse_bool(text: str) -> bool:
    """``"yes"``, ``" On"``, ``"1"`` -> True; ``"no"``, ``"off"``, ``"0"`` -> False; ValueError for other text."""
    lowered = text.strip().lower()
    if lowered in TRUE_WORDS | FALSE_WORDS:
        return lowered in TRUE_WORDS
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def split_option(text: str, what: str = "option", *, error: type[Exception] = ValueError) -> tuple[str, str]:
    """``"sync-every = 20"`` -> ``("sync_every", "20")``; `error` naming `what` if it is not NAME=VALUE."""
    name, sep, value = text.partition("=")
    name = option_name(name)
    if not sep or not name:
        raise error(f"{what} {text!r} is not of the form NAME=VALUE")
    return name, value.strip()


def parse_options(pairs: Iterable[str], what: str = "option", *, error: type[Exception] = ValueError) -> dict[str, str]:
    """``["seq_len=64", "non-iid=0.5"]`` -> ``{"seq_len": "64", "non_iid": "0.5"}``; a later pair wins."""
    return dict(split_option(pair, what, error=error) for pair in pairs)


def config_from_options(config_class: type[ConfigT], options: Mapping[str, Any], *,
                        error: type[Exception] = ValueError) -> ConfigT:
    """`config_class` from its defaults overridden by `options` (typed values or text).

    Raises `error` for unknown names (listing the known ones), for a value that is not of its
    field's type, and for whatever the config's own checks refuse. A refusal that already is
    an `error` passes through as it is; other TypeErrors and ValueErrors are re-raised as
    `error`, prefixed with the config's name.
    """
    fields = [f.name for f in dataclasses.fields(config_class) if f.init]  # type: ignore[arg-type]
    named = {key: option_name(key) for key in options}
    unknown = [key for key, name in named.items() if name not in fields]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise error(f"unknown option{plural} {', '.join(map(repr, unknown))} for {config_class.__name__}; "
                    f"known options: {', '.join(fields)}")
    hints = typing.get_type_hints(config_class)
    values = {named[key]: coerce_option(named[key], value, hints[named[key]], error=error)
              for key, value in options.items()}
    try:
        return config_class(**values)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, error):
            raise
        raise error(f"{config_class.__name__}: {exc}") from None


def coerce_option(name: str, value: Any, kind: Any, *, error: type[Exception] = ValueError) -> Any:
    """`value` as a `kind` (bool, int, float or str; ``X | None`` also takes None).

    Text is parsed (``"yes"``, ``" 20 "``, ``"1e-3"``). A typed value must be of the kind
    already: a bool is not a number and 6.5 is not an int, though an int is a float. Kinds
    other than these four are the config's to check, so their values pass as they are.
    """
    kind, optional = _unwrap_optional(kind)
    if value is None and optional:
        return None
    if isinstance(value, str) and kind in (bool, int, float):
        try:
            return parse_bool(value) if kind is bool else kind(value.strip())
        except ValueError:
            pass
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int or kind is float:
        if not isinstance(value, bool) and isinstance(value, numbers.Integral if kind is int else numbers.Real):
            return kind(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise error(f"option {name}={value!r}: expected {kind.__name__}")


def _unwrap_optional(kind: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``; (kind, False) for anything else, other unions included."""
    if typing.get_origin(kind) not in (typing.Union, types.UnionType):
        return kind, False
    args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if len(args) == 1 and len(typing.get_args(kind)) == 2:
        return args[0], True
    return kind, False
