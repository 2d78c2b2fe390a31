"""The `starling` command: a thin layer over the Python API.

This module is the wiring: the typer app and its command groups, each command living in
the module of its group (keys, node, watch, simulate, protocols, plot). Every expected failure
(bad address, unreadable key, unreachable peer) is one clear line on stderr and a
non-zero exit, never a traceback (`starling.cli.shared.fail`).
"""
from __future__ import annotations

import gc

import typer

from starling.cli import keys, node, plot, protocols, simulate, watch
from starling.cli.shared import EXTRA, EXTRA_HELP, OneLineErrors

app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, add_completion=False,
                  help="Starling: train one model across peers linked by slow, unreliable links.")
node_app = typer.Typer(no_args_is_help=True, help="Run or inspect a swarm node.")
app.add_typer(node_app, name="node")

# Every command's help ends with an example.
EXAMPLES = {
    "keygen": "starling keygen --out ~/.starling/identity.key",
    "start": "starling node start --listen tcp://0.0.0.0:7000 --protocol streaming-diloco --task charlm "
             "--checkpoint-dir ckpt",
    "status": "starling node status 'tcp://203.0.113.5:7000#KEY' --json",
    "watch": "starling node watch 'tcp://203.0.113.5:7000#KEY' --interval-s 2",
    "simulate": "starling simulate --peers 8 --protocol gossip --topology ring --bandwidth 100mbit --out runs/ring",
    "protocols": "starling protocols streaming-diloco",
    "plot": "starling plot runs/ring runs/other --out loss.png",
}


def _epilog(name: str, more: str = "") -> str:
    return f"{more}\n\nExample: {EXAMPLES[name]}" if more else f"Example: {EXAMPLES[name]}"


def _print_version(value: bool) -> None:
    if value:
        from starling.node.version import describe

        typer.echo(describe())
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version,
        help="Print the package version, the wire versions this build speaks, and its capabilities.")) -> None:
    """Starling: train one model across peers linked by slow, unreliable links."""


# Registered in the order `starling --help` lists them.
app.command(epilog=_epilog("keygen"))(keys.keygen)
node_app.command("start", context_settings=EXTRA, epilog=_epilog("start", EXTRA_HELP))(node.node_start)
node_app.command("status", epilog=_epilog("status"))(node.node_status)
node_app.command("watch", epilog=_epilog("watch"))(watch.node_watch)
app.command(context_settings=EXTRA, epilog=_epilog("simulate", EXTRA_HELP))(simulate.simulate)
app.command("protocols", epilog=_epilog("protocols"))(protocols.protocols_cmd)
app.command(epilog=_epilog("plot"))(plot.plot)

def main() -> None:
    try:
        app()
    finally:
        # The interpreter's last garbage collection walks every object a training run left
        # (1 s for a small model; 30 s and more on a loaded box, where a swarm that finished
        # together looked hung). Everything that must be flushed is closed by now: skip it.
        gc.freeze()


if __name__ == "__main__":
    main()
