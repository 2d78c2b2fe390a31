"""`starling protocols [NAME]`: the registered protocols, or one protocol's hyper-parameters."""
from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Optional

import typer

from starling.cli.shared import fail


def protocols_cmd(
    name: Optional[str] = typer.Argument(None, help="A protocol to list the hyper-parameters of."),
) -> None:
    """List the registered protocols, or one protocol's hyper-parameters with their defaults."""
    from starling.protocols import ProtocolError, registered_protocols
    from starling.runtime import resolve_protocol

    if name is None:
        for known in registered_protocols():
            doc = (sys.modules[resolve_protocol(known).__module__].__doc__ or "").strip().splitlines()
            typer.echo(f"{known:<18} {doc[0] if doc else ''}")
        return
    try:
        cls = resolve_protocol(name)
    except ProtocolError as exc:
        fail(str(exc))
    hints = typing.get_type_hints(cls.config_class)
    for f in dataclasses.fields(cls.config_class):
        kind = getattr(hints[f.name], "__name__", str(hints[f.name]))
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        typer.echo(f"--{f.name.replace('_', '-'):<22} {kind:<8} default {default!r}")
