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
from typing import Any, List, Optional

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


_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
_EXTRA_HELP = ("Any other --NAME VALUE is a hyper-parameter of the protocol (a field of its config; "
               "`starling protocols NAME` lists them), e.g. --sync-every 20 --fragments 4.")


def _extra_options(args: List[str]) -> dict[str, Any]:
    """Protocol hyper-parameters given as --name VALUE, --name=VALUE or a bare --flag (true)."""
    options: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected argument {arg!r}")
        name, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"
        options[name.replace("-", "_")] = value
        i += 1
    return options


def _pairs(pairs: List[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{what} {pair!r} is not of the form NAME=VALUE")
        out[name.strip().replace("-", "_")] = value.strip()
    return out


@node_app.command("start", context_settings=_EXTRA, epilog=_EXTRA_HELP)
def node_start(
    ctx: typer.Context,
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
    heartbeat_fanout: int = typer.Option(6, "--heartbeat-fanout", min=1, help="Peers pinged per heartbeat once the swarm is larger (beats of the others ride along)."),
    protocol: Optional[str] = typer.Option(None, "--protocol", help="Train with this protocol (a joiner may omit it: it learns it from the swarm)."),
    task: Optional[str] = typer.Option(None, "--task", help="Built-in task or module:callable (default charlm; a joiner learns it)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Stop training at this swarm step (default: run until stopped)."),
    compressor: Optional[str] = typer.Option(None, "--compressor", help="Compressor spec (a protocol option)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate (a protocol option)."),
    opt: Optional[List[str]] = typer.Option(None, "--opt", help="Protocol option NAME=VALUE (repeatable)."),
    task_opt: Optional[List[str]] = typer.Option(None, "--task-opt", help="Task option NAME=VALUE (repeatable)."),
    seed: int = typer.Option(0, "--seed", help="Swarm seed (data order, shared randomness)."),
    shard: Optional[str] = typer.Option(None, "--shard", help="This peer's data shard RANK/WORLD (default: picked from the peer id out of 16)."),
    log_every: int = typer.Option(10, "--log-every", help="Print a JSON progress line every N steps."),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Start a node and run until SIGINT/SIGTERM, then leave the swarm gracefully.

    With --protocol (or when joining a swarm that trains), the node also trains: the first
    node fixes the protocol, its hyper-parameters and the task; joiners learn them, fetch
    the swarm's state and continue at its round."""
    from starling.node.node import JoinError, Node, NodeConfig
    from starling.node.transfer import TransferError
    from starling.protocols.base import ProtocolError
    from starling.runtime import TrainSpec, TrainSpecError, with_run_length
    from starling.tasks import TaskSpecError

    _setup_logging(log_level)
    train_errors = (TrainSpecError, ProtocolError, TaskSpecError, TransferError)
    try:
        options = {**_pairs(opt or [], "protocol option"), **_extra_options(ctx.args)}
        if compressor is not None:
            options["compressor"] = compressor
        if lr is not None:
            options["lr"] = str(lr)
        rank_world = _parse_shard(shard)
        wanted: dict[str, Any] = {}
        if protocol is not None:
            spec = TrainSpec(protocol, task or "charlm", with_run_length(protocol, options, steps),
                             _pairs(task_opt or [], "task option"), seed)
            spec.check()
            wanted = spec.to_swarm_config()
            if join:  # a joiner insists only on what it was told; the rest it learns from the swarm
                given = {"protocol": True, "task": task is not None, "options": bool(options),
                         "task_options": bool(task_opt), "seed": False}
                wanted = {k: v for k, v in wanted.items() if given[k]}
                if "options" in wanted:  # not the run length it filled in: its --steps is where it stops
                    wanted["options"] = dict(options)
        elif task is not None or options or task_opt:
            raise ValueError("--task and protocol options need --protocol (or join a training swarm without them)")
        config = NodeConfig(liveness=Liveness(heartbeat_s, suspect_after_s, dead_after_s, heartbeat_fanout))
        node = Node(config=config).start(
            listen, join or [], key=key, advertise=advertise, authorized_keys=authorized_keys,
            security="plaintext" if plaintext else None, insecure=insecure, swarm_config=wanted or None,
        )
    except JoinError as exc:
        fail(str(exc))
    except (*train_errors, *EXPECTED_ERRORS) as exc:
        fail(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    typer.echo(f"starling node {node.peer_id} listening; join with: {node.address}", err=False)
    sys.stdout.flush()
    trains = protocol is not None or bool((node.swarm_config or {}).get("protocol"))
    try:
        if trains:
            _train(node, rank_world, steps, log_every, stop)
        else:
            stop.wait()
    except train_errors as exc:
        node.close()
        fail(str(exc))
    logging.getLogger(__name__).info("leaving the swarm")
    node.leave()


def _parse_shard(shard: Optional[str]) -> Optional[tuple[int, int]]:
    if shard is None:
        return None
    rank, sep, world = shard.partition("/")
    try:
        r, w = int(rank), int(world)
    except ValueError:
        raise ValueError(f"--shard must be RANK/WORLD, got {shard!r}") from None
    if not sep or w < 1 or not 0 <= r < w:
        raise ValueError(f"--shard must be RANK/WORLD with 0 <= RANK < WORLD, got {shard!r}")
    return r, w


def _train(node: Any, rank_world: Optional[tuple[int, int]], steps: Optional[int], log_every: int,
           stop: threading.Event) -> None:
    """The node's training loop: one JSON progress line every `log_every` steps."""
    import time

    from starling.runtime import Trainer, TrainSpec, shard_for

    spec = TrainSpec.from_swarm_config(node.swarm_config)
    rank, world = rank_world or (shard_for(node.peer_id, 16), 16)
    trainer = Trainer(node, spec, rank, world)
    trainer.create_protocol()
    if node.live_peers():
        trainer.fetch_state()
    start, sent = time.monotonic(), [0]
    typer.echo(json.dumps({"event": "training", "protocol": spec.protocol, "task": spec.task,
                           "shard": f"{rank}/{world}", "step": trainer.proto.step_count}))  # type: ignore[union-attr]

    def on_report(report: Any) -> None:
        sent[0] += report.bytes_sent
        if log_every and (report.step + 1) % log_every == 0:
            typer.echo(json.dumps({"step": report.step + 1, "loss": round(report.loss, 5), "peers": report.peers,
                                   "bytes_sent": sent[0], "wall_s": round(time.monotonic() - start, 2)}))
            sys.stdout.flush()

    try:
        final = trainer.run(steps, stop, on_report)
        metrics = trainer.evaluate()
        stopped = {"event": "stopped", "step": final, **{k: round(v, 5) for k, v in metrics.items()}}
        info = trainer.proto.describe()  # type: ignore[union-attr]
        if "privacy" in info:  # what a private protocol (sketch-dp) has spent
            stopped["privacy"] = info["privacy"]
        typer.echo(json.dumps(stopped, default=str))
        sys.stdout.flush()
    finally:
        trainer.close()


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


# ---------------------------------------------------------------- simulate and plot
DEFAULT_SIM_PROTOCOL = "gossip"
DEFAULT_SIM_STEPS = 60  # the default command (a run plus its allreduce baseline) takes about a minute on 2 cores


def _sim_configs(*, peers: int, protocol: str, task: str, steps: int, compressor: Optional[str],
                 transport: Optional[str], processes: bool, bandwidth: Optional[str], latency_ms: float,
                 loss: float, churn: Optional[str], seed: int, opt: List[str], lr: Optional[float],
                 task_opt: List[str], eval_every: int, baseline: str) -> tuple[Any, Any]:
    """The run's SimConfig and the baseline's (None for --baseline none); ValueError on bad input."""
    from dataclasses import fields, replace

    from starling.runtime import LinkModel, SimConfig, check_config, parse_churn, parse_rate, resolve_protocol
    from starling.tasks import parse_options

    if latency_ms < 0:
        raise ValueError(f"--latency must be >= 0 ms, got {latency_ms:g}")
    if not 0 <= loss < 1:
        raise ValueError(f"--loss must be in [0, 1), got {loss:g}")
    link = LinkModel(parse_rate(bandwidth) if bandwidth else None, latency_ms / 1000.0, loss, seed)
    options = _pairs(opt, "protocol option")
    if lr is not None:
        options["lr"] = lr
    config = SimConfig(
        peers=peers, protocol=protocol, task=task, steps=steps, compressor=compressor,
        transport=transport or ("tcp" if processes else "inproc"), processes=processes, link=link,
        churn=parse_churn(churn) if churn else (), seed=seed, options=options,
        task_options=parse_options(task_opt), eval_every=eval_every,
    )
    check_config(config)
    if baseline.lower() == "none":
        return config, None
    # The baseline shares the hyper-parameters it knows (lr, timeouts), not the run's compressor.
    known = {f.name for f in fields(resolve_protocol(baseline).config_class)} - {"compressor"}
    base = replace(config, protocol=baseline, compressor=None,
                   options={k: v for k, v in options.items() if k.replace("-", "_") in known})
    check_config(base)
    return config, base


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt(value: Optional[float], spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    base = summary.get("baseline")
    table = Table(title=f"starling simulate: {summary['task']}, {summary['steps']} steps")
    for column in ("protocol", "peers", "train loss", "eval loss", "sent/peer", "vs baseline", "wall s"):
        table.add_column(column, justify="left" if column == "protocol" else "right", no_wrap=True)
    rows = [(summary["protocol"], summary)]
    if base:
        rows.append((f"{base['protocol']} (baseline)", base))
    for label, s in rows:
        ratio = "-"
        if base and base["bytes_sent_per_peer"]:
            ratio = f"{s['bytes_sent_per_peer'] / base['bytes_sent_per_peer']:.3g}x"
        table.add_row(label, str(s["peers"]), _fmt(s["train_loss"]), _fmt(s["eval_loss"]),
                      _human_bytes(s["bytes_sent_per_peer"]), ratio, f"{s['wall_s']:.1f}")
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(table)
    privacy = _privacy_table(summary)
    if privacy is not None:
        console.print(privacy)


# Headings for the privacy report's fields (protocols/privacy.py PrivacyReport); any other field
# a protocol reports is printed under its own name, after these.
_PRIVACY_HEADINGS = {"epsilon": "epsilon", "delta": "delta", "noise_multiplier": "sigma", "clip": "C",
                     "dp_unit": "unit"}


def _privacy_table(summary: dict[str, Any]) -> Any:
    """The privacy a protocol reports having spent (sketch-dp), or None when it reports none."""
    from rich.table import Table

    info = summary.get("protocol_info") or {}
    privacy = info.get("privacy")
    if not isinstance(privacy, dict) or not privacy:
        return None
    cells = {heading: privacy[key] for key, heading in _PRIVACY_HEADINGS.items() if key in privacy}
    if "sketch_size" in info:
        cells["sketch"] = info["sketch_size"]
    cells.update({key.replace("_", " "): value for key, value in privacy.items() if key not in _PRIVACY_HEADINGS})
    table = Table(title=f"{summary['protocol']}: privacy spent")
    for heading, value in cells.items():
        table.add_column(heading, justify="left" if isinstance(value, str) else "right")
    table.add_row(*(_cell(value) for value in cells.values()))
    return table


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return format(value, ".4g")
    return str(value)


@app.command(context_settings=_EXTRA, epilog=_EXTRA_HELP)
def simulate(
    ctx: typer.Context,
    peers: int = typer.Option(4, "--peers", help="Simulated peers at the start."),
    protocol: str = typer.Option(DEFAULT_SIM_PROTOCOL, "--protocol", help="Protocol name (or module:name)."),
    task: str = typer.Option("charlm", "--task", help="Built-in task name or module:callable."),
    steps: int = typer.Option(DEFAULT_SIM_STEPS, "--steps", help="Training steps per peer."),
    compressor: Optional[str] = typer.Option(None, "--compressor", help="Compressor spec, e.g. topk:0.01+int8."),
    transport: Optional[str] = typer.Option(None, "--transport", help="inproc, ipc or tcp (default inproc; tcp with --processes)."),
    processes: bool = typer.Option(False, "--processes", help="One OS process per peer (tcp on loopback)."),
    bandwidth: Optional[str] = typer.Option(None, "--bandwidth", help="Per-link bandwidth, e.g. 100mbit, 10Mbps, 1gbit."),
    latency_ms: float = typer.Option(0.0, "--latency", help="One-way latency per link, in ms."),
    loss: float = typer.Option(0.0, "--loss", help="Probability that a protocol message is lost."),
    churn: Optional[str] = typer.Option(None, "--churn", help="e.g. kill:1@50,leave:2@60,join@80 (STEP = swarm step)."),
    seed: int = typer.Option(0, "--seed", help="Data order, the simulated peers' keys and the links' randomness "
                             "(see the README for which runs repeat bit for bit)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write per-peer metrics (JSON lines) and summary.json here."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
    baseline: str = typer.Option("allreduce", "--baseline", help="Protocol to compare against, or none."),
    opt: Optional[List[str]] = typer.Option(None, "--opt", help="Protocol option NAME=VALUE (repeatable)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate (a protocol option)."),
    task_opt: Optional[List[str]] = typer.Option(None, "--task-opt", help="Task option NAME=VALUE (repeatable)."),
    eval_every: int = typer.Option(0, "--eval-every", help="Peer 0 evaluates every N steps (0: at the end only)."),
    log_level: str = typer.Option("warning", "--log-level"),
) -> None:
    """Run a swarm of real nodes on this machine over emulated links and compare it with a baseline."""
    from starling.node.node import JoinError
    from starling.node.transfer import TransferError
    from starling.protocols.base import ProtocolError
    from starling.runtime import SimError, Simulation

    _setup_logging(log_level)
    errors = (SimError, ProtocolError, JoinError, TransferError, *EXPECTED_ERRORS)
    try:
        config, base = _sim_configs(
            peers=peers, protocol=protocol, task=task, steps=steps, compressor=compressor, transport=transport,
            processes=processes, bandwidth=bandwidth, latency_ms=latency_ms, loss=loss, churn=churn, seed=seed,
            opt=[*(opt or []), *(f"{k}={v}" for k, v in _extra_options(ctx.args).items())], lr=lr, task_opt=task_opt or [], eval_every=eval_every, baseline=baseline)
    except errors as exc:
        fail(str(exc))
    runs = [("run", config)] + ([("baseline", base)] if base is not None and base.protocol != config.protocol else [])
    show_progress = not as_json and sys.stderr.isatty()
    results = {}
    try:
        if show_progress:
            from rich.console import Console
            from rich.progress import Progress

            with Progress(console=Console(stderr=True), transient=True) as bar:
                for label, cfg in runs:
                    job = bar.add_task(f"{label}: {cfg.protocol}", total=cfg.steps)
                    results[label] = Simulation(cfg, lambda step, job=job: bar.update(job, completed=step)).run()
        else:
            for label, cfg in runs:
                results[label] = Simulation(cfg).run()
    except errors as exc:
        fail(str(exc))
    summary = dict(results["run"].summary)
    if base is not None:
        summary["baseline"] = results["baseline"].summary if "baseline" in results else dict(results["run"].summary)
    if out is not None:
        try:
            results["run"].write(out)
            if "baseline" in results:
                results["baseline"].write(out / "baseline")
            (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        except OSError as exc:
            fail(f"cannot write results to {out}: {exc}")
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        _print_table(summary)


@app.command("protocols")
def protocols_cmd(
    name: Optional[str] = typer.Argument(None, help="A protocol to list the hyper-parameters of."),
) -> None:
    """List the registered protocols, or one protocol's hyper-parameters with their defaults."""
    import dataclasses
    import typing

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


def _load_curve(run_dir: Path) -> tuple[str, list[float], list[float], list[float]]:
    """(label, mean bytes sent per peer, mean train loss, wall s) per step of one run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    by_step: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(run_dir.glob("peer-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                by_step.setdefault(int(record["step"]), []).append(record)
    steps = sorted(by_step)
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    return (f"{summary['protocol']} ({run_dir.name})", [mean(by_step[s], "bytes_sent") for s in steps],
            [mean(by_step[s], "loss") for s in steps], [max(r["wall_s"] for r in by_step[s]) for s in steps])


@app.command()
def plot(
    dirs: List[Path] = typer.Argument(..., help="Run directories written by `starling simulate --out`."),
    out: Optional[Path] = typer.Option(None, "--out", help="PNG to write (default: DIR/plot.png of the first run)."),
) -> None:
    """Draw loss versus bytes sent and loss versus wall time for one or more runs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("plotting needs matplotlib, which is not installed: pip install matplotlib")
    run_dirs: list[Path] = []
    for d in dirs:
        if not (d / "summary.json").is_file():
            fail(f"{d} is not a simulate --out directory (no summary.json)")
        run_dirs.append(d)
        if (d / "baseline" / "summary.json").is_file():
            run_dirs.append(d / "baseline")
    try:
        curves = [_load_curve(d) for d in run_dirs]
    except (OSError, ValueError, KeyError) as exc:
        fail(f"cannot read run metrics: {exc}")
    figure, (by_bytes, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, sent, losses, wall in curves:
        by_bytes.plot([b / 2**20 for b in sent], losses, label=label)
        by_time.plot(wall, losses, label=label)
    by_bytes.set(xlabel="MiB sent per peer", ylabel="train loss", title="loss vs bytes sent")
    by_time.set(xlabel="wall time (s)", ylabel="train loss", title="loss vs wall time")
    by_bytes.legend()
    target = out or dirs[0] / "plot.png"
    try:
        figure.tight_layout()
        figure.savefig(target, dpi=120)
    except OSError as exc:
        fail(f"cannot write {target}: {exc}")
    finally:
        plt.close(figure)
    typer.echo(str(target))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
