"""`starling simulate`: a swarm of real nodes on this machine over emulated links, compared
with a baseline protocol, as a table or JSON."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import typer

if TYPE_CHECKING:
    from starling.runtime import SimConfig, SimResult

from starling.cli.shared import (
    EXPECTED_ERRORS,
    autocast_option,
    data_option,
    device_option,
    dtype_option,
    fail,
    prepare_units,
    protocol_options,
    seq_len_option,
    setup_logging,
    state_device_option,
    tokenizer_option,
    with_data,
)
from starling.common import parse_options


def partition_options(task: str, spec: str, by: Optional[str]) -> dict[str, str]:
    """The task options of `--partition SPEC` (and `--partition-by`) for `task`, checked:
    ValueError if the spec is malformed or the task's samples have no labels to partition by."""
    import dataclasses

    from starling.tasks import get_task
    from starling.tasks.partition import Partition

    parsed = Partition.parse(spec)
    config = getattr(get_task(task), "config", None)
    fields = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    if "partition" not in fields:
        raise ValueError(f"task {task!r} has no labels to partition its data by; --partition applies to teacher, "
                         "charlm and gpt (--data)")
    if by is not None and "partition_by" not in fields:
        raise ValueError(f"--partition-by goes with --data (the gpt task); task {task!r} has its own labels")
    return {"partition": str(parsed), **({} if by is None else {"partition_by": by})}


def _sim_configs(*, peers: int, protocol: Optional[str], task: Optional[str], steps: Optional[int],
                 compressor: Optional[str], transport: Optional[str], processes: int, ray: Optional[str] = None,
                 bandwidth: Optional[str], latency_ms: float,
                 loss: float, churn: Optional[str], seed: int, opt: List[str], lr: Optional[float],
                 task_opt: List[str], eval_every: int, baseline: str, flags: Sequence[str] = (),
                 extra: Optional[dict[str, Any]] = None) -> tuple[Any, Any]:
    """The run's SimConfig and the baseline's (`SimConfig.baseline`; None for --baseline none);
    ValueError on bad input. `opt`: the --opt pairs; `flags`: the other --NAME VALUE options;
    `extra`: more SimConfig fields (placement, checkpoints). What the line leaves out (None) is
    SimConfig's default, as a run made in Python gets it."""
    from starling.runtime import LinkModel, SimConfig, check_config, parse_churn, parse_rate

    if latency_ms < 0:
        raise ValueError(f"--latency must be >= 0 ms, got {latency_ms:g}")
    if not 0 <= loss < 1:
        raise ValueError(f"--loss must be in [0, 1), got {loss:g}")
    link = LinkModel(parse_rate(bandwidth) if bandwidth else None, latency_ms / 1000.0, loss, seed)
    given = {name: value for name, value in (("protocol", protocol), ("task", task)) if value is not None}
    config = SimConfig(
        peers=peers, steps=steps, compressor=compressor, transport=transport, processes=processes, ray=ray,
        link=link, churn=parse_churn(churn) if churn else (), seed=seed, options=protocol_options(opt, flags, lr=lr),
        task_options=parse_options(task_opt, "task option"), eval_every=eval_every, **given, **(extra or {}),
    )
    check_config(config)
    if baseline.lower() == "none":
        return config, None
    base = config.baseline(baseline)
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


def bytes_ratio(run: float, base: float) -> str:
    """How a run's bytes compare with the baseline's, as a person reads it: "671x fewer",
    "1.33x more", "same"."""
    if not base:
        return "-"
    if run == base:
        return "same"
    if run == 0:
        return "none sent"
    ratio = base / run if run < base else run / base
    figure = f"{ratio:.0f}" if ratio >= 10 else f"{ratio:.3g}"
    return f"{figure}x {'fewer' if run < base else 'more'}"


def _simulate(runs: list[tuple[str, SimConfig]], progress: dict[str, Any]) -> dict[str, SimResult]:
    """Each run's result, by label: the run, then its baseline, which trains on the nodes the
    run formed where it can (`Simulation.run_compared`)."""
    from starling.runtime import Simulation

    if len(runs) == 2:
        (label, config), (base_label, base) = runs
        run, compared = Simulation(config, progress.get(label)).run_compared(base, progress.get(base_label))
        return {label: run, base_label: compared}
    return {label: Simulation(config, progress.get(label)).run() for label, config in runs}


def _label(s: dict[str, Any]) -> str:
    """ "protocol (compressor, optimizer lr)" for the table."""
    info = (s.get("protocol_info") or {}).get("config") or {}
    parts = [str(info["compressor"])] if info.get("compressor") not in (None, "none") else []
    if "sync_every" in info:
        parts.append(f"H {info['sync_every']}" + (f", F {info['fragments']}" if info.get("fragments", 1) > 1 else ""))
    optimizer = info.get("inner_optimizer") or info.get("optimizer")
    if optimizer is not None and "lr" in info:
        parts.append(f"{optimizer} lr {info['lr']:g}")
    return f"{s['protocol']} ({', '.join(parts)})" if parts else s["protocol"]


def _print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from starling.runtime.simconfig import UNCAPPED_STEPS

    base = summary.get("baseline")
    ranks = summary.get("nproc_per_replica", 1)
    who = f"{summary['peers']} replicas of {ranks} ranks" if ranks > 1 else f"{summary['peers']} peers"
    tokens = "the same tokens for every run" if base is None or base.get("nproc_per_replica", 1) == ranks else \
        "the baseline's peers one rank each"
    length = f"{summary['steps']} steps" if summary['steps'] < UNCAPPED_STEPS else f"{summary['duration_s']:g} s"
    table = Table(title=f"starling simulate: {summary['task']}, {who}, {length} each, {tokens}")
    for column in ("protocol", "train loss", "eval loss", "sent/peer", "vs baseline", "wall s"):
        table.add_column(column, justify="left" if column == "protocol" else "right", no_wrap=column != "protocol")
    rows = [(_label(summary), summary)]
    if base:
        rows.append((f"{_label(base)}, baseline", base))
    for label, s in rows:
        ratio = bytes_ratio(s["bytes_sent_per_peer"], base["bytes_sent_per_peer"]) if base and s is not base else "-"
        table.add_row(label, _fmt(s["train_loss"]), _fmt(s["eval_loss"]), _human_bytes(s["bytes_sent_per_peer"]),
                      ratio, f"{s['wall_s']:.1f}")
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


def simulate(
    ctx: typer.Context,
    peers: int = typer.Option(4, "--peers", help="Simulated peers at the start."),
    protocol: Optional[str] = typer.Option(
        None, "--protocol", help="Protocol name (or module:name; default streaming-diloco)."),
    task: Optional[str] = typer.Option(None, "--task", help="Built-in task name or module:callable (default charlm)."),
    steps: Optional[int] = typer.Option(
        None, "--steps", min=1, help="Training steps per peer (default 200; with --duration, as many "
                                     "as fit in it)."),
    compressor: Optional[str] = typer.Option(None, "--compressor", help="Compressor spec, e.g. topk:0.01+int8."),
    transport: Optional[str] = typer.Option(
        None, "--transport", help="inproc, ipc or tcp (default inproc; tcp with --processes or --ray)."),
    processes: int = typer.Option(
        0, "--processes", metavar="P",
        help="Spread the peers over P OS processes, round-robin by rank (tcp on loopback; 0: threads of this one)."),
    ray: Optional[str] = typer.Option(
        None, "--ray", metavar="ADDRESS",
        help="Run the worker processes as Ray actors spread over the machines of the Ray cluster at ADDRESS "
             "(HOST:PORT; auto: the cluster this machine joined with `ray start`; local: a new one here); tcp, "
             "and one worker per node unless --processes says how many. Needs starling[ray]."),
    bandwidth: Optional[str] = typer.Option(
        None, "--bandwidth", help="Per-link bandwidth, e.g. 100mbit, 10Mbps, 1gbit."),
    latency_ms: float = typer.Option(0.0, "--latency", help="One-way latency per link, in ms."),
    loss: float = typer.Option(0.0, "--loss", help="Probability that a protocol message is lost."),
    churn: Optional[str] = typer.Option(None, "--churn", help="e.g. kill:1@50,leave:2@60,join@80 (STEP = swarm step)."),
    seed: int = typer.Option(0, "--seed", help="Data order, the simulated peers' keys and the links' randomness "
                             "(docs/cli.md says which runs repeat bit for bit)."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Write per-peer metrics (JSON lines), summary.json and plot.png here "
                            "(default: runs/simulate-DATE-TIME; with --json, nothing unless given)."),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Draw DIR/plot.png (needs matplotlib)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
    baseline: str = typer.Option("allreduce", "--baseline", help="Protocol to compare against, or none."),
    opt: Optional[List[str]] = typer.Option(None, "--opt", help="Protocol option NAME=VALUE (repeatable)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate (a protocol option)."),
    task_opt: Optional[List[str]] = typer.Option(None, "--task-opt", help="Task option NAME=VALUE (repeatable)."),
    data: Optional[str] = data_option(),
    tokenizer: Optional[str] = tokenizer_option(),
    seq_len: Optional[int] = seq_len_option(),
    eval_every: int = typer.Option(0, "--eval-every", help="Peer 0 evaluates every N steps (0: at the end only)."),
    device: Optional[str] = device_option("every peer's"),
    dtype: Optional[str] = dtype_option(),
    autocast: Optional[str] = autocast_option(),
    state_device: Optional[str] = state_device_option(),
    peer_speed: Optional[str] = typer.Option(
        None, "--peer-speed", metavar="V,V,...",
        help="Relative compute speed of each peer, e.g. 1,1,1,0.33: a slower peer sleeps on its training thread "
             "for the compute it lacks (one value per --peers, each > 0)."),
    duration: float = typer.Option(
        0.0, "--duration", metavar="SECONDS",
        help="Wall-clock budget: every peer stops training this long after the start, leaves and evaluates "
             "(--steps, if given, stays an upper bound; 0: run the steps). Compares protocols on the same time."),
    nproc_per_replica: int = typer.Option(
        1, "--nproc-per-replica", min=1, metavar="N",
        help="Every peer is a replica of N gloo ranks, each its own process: DDP inside a replica, the protocol "
             "between replicas (diloco, streaming-diloco; an allreduce baseline runs single-process peers)."),
    partition: Optional[str] = typer.Option(
        None, "--partition", metavar="iid|dirichlet:ALPHA|shards:K",
        help="How the peers' data differ, as Flower's partitioners define it: each peer's label distribution "
             "(teacher: its classes; charlm: the stdlib file a window starts in; --data: see --partition-by). "
             "Each peer then trains only its own part."),
    partition_by: Optional[str] = typer.Option(
        None, "--partition-by", metavar="document|folder|COLUMN",
        help="With --data and --partition: what labels a document (default document: each its own; folder: a text "
             "folder's subfolders; or a column of a table)."),
    shard_sync: bool = typer.Option(
        False, "--shard-sync", help="With --nproc-per-replica N: FSDP2 inside each replica, and every rank syncs its "
                                    "own shard of the model with the same rank of the other replicas (one sub-swarm "
                                    "per rank), instead of rank 0 syncing the whole model."),
    max_dealers: Optional[int] = typer.Option(
        None, "--max-dealers", min=1, help="Sockets each simulated peer keeps open to others (default: the largest "
                                           "up to a real node's 64 that fits this process's descriptors; over "
                                           "tcp or ipc past 128 peers, also within 8,192 connections in all, "
                                           "and at least log2 of the swarm)."),
    checkpoint_dir: Optional[Path] = typer.Option(
        None, "--checkpoint-dir", help="Every peer writes checkpoints to DIR/peer-RANK (the baseline's to "
                                       "DIR/baseline/peer-RANK)."),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", min=1, help="Steps between checkpoints."),
    resume: bool = typer.Option(
        False, "--resume", help="Every peer first loads its newest checkpoint from --checkpoint-dir."),
    log_level: str = typer.Option("warning", "--log-level"),
) -> None:
    """Run a swarm of real nodes on this machine over emulated links and compare it with a baseline."""
    from starling.node.node import JoinError
    from starling.node.transfer import TransferError
    from starling.protocols.base import ProtocolError
    from starling.runtime import SimError
    from starling.runtime.simconfig import DEFAULT_SIM_TASK, UNCAPPED_STEPS

    setup_logging(log_level)
    errors = (SimError, ProtocolError, JoinError, TransferError, *EXPECTED_ERRORS)
    try:
        task, task_options = with_data(task, parse_options(task_opt or [], "task option"), data, tokenizer, seq_len)
        task = task or DEFAULT_SIM_TASK
        if partition is not None:
            task_options = {**task_options, **partition_options(task, partition, partition_by)}
        elif partition_by is not None:
            raise ValueError("--partition-by goes with --partition")
        prepare_units(task, task_options)
        task_opt = [f"{name}={value}" for name, value in task_options.items()]
        config, base = _sim_configs(
            peers=peers, protocol=protocol, task=task, steps=steps, compressor=compressor, transport=transport,
            processes=processes, ray=ray, bandwidth=bandwidth, latency_ms=latency_ms, loss=loss, churn=churn, seed=seed,
            opt=opt or [], flags=ctx.args, lr=lr, task_opt=task_opt or [], eval_every=eval_every, baseline=baseline,
            extra={"device": device, "dtype": dtype, "autocast": autocast, "state_device": state_device,
                   "max_dealers": max_dealers, "peer_speed": parse_peer_speed(peer_speed, peers),
                   "duration_s": duration, "nproc_per_replica": nproc_per_replica, "shard_sync": shard_sync,
                   "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir),
                   "checkpoint_every": checkpoint_every, "resume": resume})
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
                shown = {}
                for label, cfg in runs:
                    total = cfg.steps if cfg.steps < UNCAPPED_STEPS else None  # a --duration run: no end in steps
                    job = bar.add_task(f"{label}: {cfg.protocol}", total=total)
                    shown[label] = lambda step, job=job: bar.update(job, completed=step)
                results = _simulate(runs, shown)
        else:
            results = _simulate(runs, {})
    except errors as exc:
        fail(str(exc))
    summary = dict(results["run"].summary)
    if out is None and not as_json:
        out = default_run_dir()
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
    drawn = _draw(out) if out is not None and plot else None
    if as_json:
        typer.echo(json.dumps(summary))
        return
    _print_table(summary)
    from starling.runtime import busy_note, liveness_note, spsa_bytes_note

    busy = [("", liveness_note(summary)), ("", busy_note(summary))]
    if "baseline" in results:  # a run that is its own baseline has one line
        busy.append(("baseline ", busy_note(results["baseline"].summary)))
    for label, line in busy:
        if line:
            typer.echo(label + line)
    note = spsa_bytes_note(summary)
    if note:
        typer.echo(note)
    if out is not None:
        typer.echo(f"run written to {out}" + (f"; plot: {drawn}" if drawn else ""))


def parse_peer_speed(text: Optional[str], peers: int) -> tuple[float, ...]:
    """--peer-speed's comma-separated speeds; ValueError naming what is wrong."""
    if text is None:
        return ()
    try:
        speeds = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--peer-speed takes numbers separated by commas (e.g. 1,1,1,0.33), got {text!r}") from None
    if len(speeds) != peers:
        raise ValueError(f"--peer-speed names {len(speeds)} speeds for {peers} peers (--peers): give one per peer")
    bad = [v for v in speeds if not 0.0 < v < float("inf")]
    if bad:
        raise ValueError(f"--peer-speed values must be finite numbers > 0, got {bad[0]:g}")
    return speeds


def default_run_dir(root: Path = Path("runs")) -> Path:
    """A fresh directory name for a run that named no --out: runs/simulate-DATE-TIME[-N]."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = root / f"simulate-{stamp}", 1
    while candidate.exists():
        n += 1
        candidate = root / f"simulate-{stamp}-{n}"
    return candidate


def _draw(out: Path) -> Optional[Path]:
    """Write out/plot.png next to the run; a missing matplotlib or an unwritable file is a
    warning on stderr (the run's results are already on disk), not a failure."""
    from starling.cli.plot import PlotError, write_plot

    try:
        return write_plot([out], out / "plot.png")
    except PlotError as exc:
        typer.echo(f"warning: no plot drawn: {exc}", err=True)
        return None
