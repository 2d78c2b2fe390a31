"""The `starling` command: a thin layer over the Python API.

Every expected failure (bad address, unreadable key, unreachable peer) is one clear
line on stderr and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import List, Optional

import typer

from starling.node.address import AddressError
from starling.node.identity import Identity, KeyFileError
from starling.node.membership import Liveness
from starling.node.security import SecurityError

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Starling: train one model across peers linked by slow, unreliable links.")
node_app = typer.Typer(no_args_is_help=True, help="Run or inspect a swarm node.")
app.add_typer(node_app, name="node")

DEFAULT_KEY = Path.home() / ".starling" / "identity.key"
EXPECTED_ERRORS = (AddressError, KeyFileError, SecurityError, OSError, ValueError, TimeoutError)


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"starling: error: {message}", err=True)
    raise typer.Exit(code)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@app.command()
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


@node_app.command("start")
def node_start(
    listen: List[str] = typer.Option(["tcp://127.0.0.1:0"], "--listen", help="Endpoint to bind (repeatable); port 0 picks a free one."),
    advertise: Optional[List[str]] = typer.Option(None, "--advertise", help="Address peers should dial instead of the bound one (NAT, port forwarding)."),
    join: Optional[List[str]] = typer.Option(None, "--join", help="Join address of a swarm member, tcp://HOST:PORT#KEY (repeatable)."),
    key: Optional[Path] = typer.Option(None, "--key", help="Identity key file (default: a fresh throwaway identity)."),
    authorized_keys: Optional[Path] = typer.Option(None, "--authorized-keys", help="Allowlist of peer keys; others cannot connect."),
    plaintext: bool = typer.Option(False, "--plaintext", help="No encryption (simulations on one box only)."),
    insecure: bool = typer.Option(False, "--insecure", help="Allow --plaintext on non-loopback addresses."),
    heartbeat_s: float = typer.Option(1.0, "--heartbeat-s", help="Heartbeat interval."),
    suspect_after_s: float = typer.Option(3.0, "--suspect-after-s", help="Silence before a peer is suspect."),
    dead_after_s: float = typer.Option(10.0, "--dead-after-s", help="Silence before a peer is dead."),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Start a node and run until SIGINT/SIGTERM, then leave the swarm gracefully."""
    from starling.node.node import JoinError, Node, NodeConfig

    _setup_logging(log_level)
    try:
        config = NodeConfig(liveness=Liveness(heartbeat_s, suspect_after_s, dead_after_s))
        node = Node(config=config).start(
            listen, join or [], key=key, advertise=advertise, authorized_keys=authorized_keys,
            security="plaintext" if plaintext else None, insecure=insecure,
        )
    except JoinError as exc:
        fail(str(exc))
    except EXPECTED_ERRORS as exc:
        fail(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    typer.echo(f"starling node {node.peer_id} listening; join with: {node.address}", err=False)
    sys.stdout.flush()
    stop.wait()
    logging.getLogger(__name__).info("leaving the swarm")
    node.leave()


@node_app.command("status")
def node_status(
    address: str = typer.Argument(..., help="Join address of the node to ask."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    key: Optional[Path] = typer.Option(None, "--key", help="Identity to authenticate with (for allowlisted swarms)."),
    timeout_s: float = typer.Option(5.0, "--timeout-s"),
) -> None:
    """Ask a running node for its peer table and stats."""
    from starling.node.client import ClientError, query

    try:
        identity = Identity.load(key) if key else None
        status = query(address, identity=identity, timeout_s=timeout_s)
    except (ClientError, *EXPECTED_ERRORS) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(status, default=str))
        return
    typer.echo(f"node {status['id']}  {status['address']}  ({status['security']})")
    for p in status["peers"]:
        typer.echo(f"  {p['id']}  {p['status']:<8} seen {p['last_seen_s']:.1f}s ago  {' '.join(p['addresses'])}")
    stats = status["stats"]
    typer.echo(f"  sent {sum(sum(t.values()) for t in stats['bytes_sent'].values())} B, "
               f"received {sum(sum(t.values()) for t in stats['bytes_received'].values())} B, "
               f"rejected {sum(stats['rejected'].values())}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
