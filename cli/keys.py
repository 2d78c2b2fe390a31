"""`starling keygen`: a peer identity in a file only its owner can read."""
from __future__ import annotations

from pathlib import Path

import typer

from starling.cli.shared import fail
from starling.node.identity import Identity, KeyFileError

DEFAULT_KEY = Path.home() / ".starling" / "identity.key"


def keygen(
    out: Path = typer.Option(DEFAULT_KEY, "--out", help="Key file to create (mode 0600)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing key file."),
) -> None:
    """Create a peer identity (Ed25519 + Curve25519) and print its peer id."""
    if out.exists() and not force:
        fail(f"{out} already exists; pass --force to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        identity = Identity.generate()
        identity.save(out, overwrite=force)
    except (KeyFileError, OSError) as exc:
        fail(str(exc))
    typer.echo(identity.peer_id)
