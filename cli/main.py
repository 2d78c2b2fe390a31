"""The `starling` command: a thin layer over the Python API.

This module is the wiring: the typer app and its command groups, each command living in
the module of its group (keys, node, simulate, protocols, plot). Every expected failure
(bad address, unreadable key, unreachable peer) is one clear line on stderr and a
non-zero exit, never a traceback (`starling.cli.shared.fail`).
"""
from __future__ import annotations

import typer

from starling.cli import keys, node, plot, protocols, simulate
from starling.cli.shared import EXTRA, EXTRA_HELP, OneLineErrors

app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, add_completion=False,
                  help="Starling: train one model across peers linked by slow, unreliable links.")
node_app = typer.Typer(no_args_is_help=True, help="Run or inspect a swarm node.")
app.add_typer(node_app, name="node")

# Registered in the order `starling --help` lists them.
app.command()(keys.keygen)
node_app.command("start", context_settings=EXTRA, epilog=EXTRA_HELP)(node.node_start)
node_app.command("status")(node.node_status)
app.command(context_settings=EXTRA, epilog=EXTRA_HELP)(simulate.simulate)
app.command("protocols")(protocols.protocols_cmd)
app.command()(plot.plot)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
