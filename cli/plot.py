"""`starling plot`: what each run's loss cost in bytes and in time, from `simulate --out` runs.

Three panels, one colour per run, labelled "protocol (compressor)":
- loss against bytes sent per peer, on a log axis: protocols differ by orders of magnitude, and
  on a linear axis everything but the costliest run is a vertical line at 0. A log axis has no
  0, so a run's steps before its first byte (and a run that sends nothing) sit at 1 B;
- loss against wall time;
- bytes each peer sent in each step, which shows when a protocol talks: all-reduce every step,
  Streaming DiLoCo in the peaks of its fragment schedule (symlog, so that a step of 0 bytes
  stays on the panel).
Train loss is the mean over the peers at each step; eval loss (peer 0, at `--eval-every` and at
the end of the run) is drawn as markers on the same colour.

`write_plot(run_dirs, out_path)` is the whole job for other commands (`simulate` calls it);
`build_figure(run_dirs)` returns the matplotlib Figure without writing it.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import typer

from starling.cli.shared import fail

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FORMATS = (".png", ".svg")  # what --out may end in; the suffix picks the format
MIN_BYTES = 1.0  # where 0 bytes is drawn on the log axis


class PlotError(ValueError):
    """A plot could not be drawn or written; the message names what was wrong."""


@dataclass
class RunCurves:
    """One run's per-step series, each peer's numbers averaged at every step."""

    label: str
    steps: list[int] = field(default_factory=list)
    bytes_sent: list[float] = field(default_factory=list)  # protocol bytes sent so far, mean per peer
    loss: list[float] = field(default_factory=list)  # train loss, mean over peers
    wall_s: list[float] = field(default_factory=list)  # the slowest peer's time at this step
    bytes_per_step: list[float] = field(default_factory=list)  # sent during this step, mean per peer
    evals: list[tuple[int, float]] = field(default_factory=list)  # (index into steps, eval loss)


def run_label(summary: dict[str, Any]) -> str:
    """ "protocol (compressor)": the compressor the protocol ran with, its default included."""
    config = (summary.get("protocol_info") or {}).get("config") or {}
    compressor = config.get("compressor") or summary.get("compressor") or "none"
    return f"{summary.get('protocol', '?')} ({compressor})"


def expand_runs(dirs: Sequence[Path]) -> list[Path]:
    """The run directories to draw: each one given, and its baseline beside it if it has one."""
    runs: list[Path] = []
    for d in dirs:
        d = Path(d)
        if not (d / "summary.json").is_file():
            raise PlotError(f"{d} is not a simulate --out directory (no summary.json)")
        runs.append(d)
        if (d / "baseline" / "summary.json").is_file():
            runs.append(d / "baseline")
    return runs


def load_run(run_dir: Path) -> RunCurves:
    """Read summary.json and every peer-RANK.jsonl of one run directory."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        by_step: dict[int, list[dict[str, Any]]] = {}
        for path in sorted(run_dir.glob("peer-*.jsonl")):
            sent_before = 0.0
            for line in path.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    record["_step_bytes"] = record["bytes_sent"] - sent_before
                    sent_before = record["bytes_sent"]
                    by_step.setdefault(int(record["step"]), []).append(record)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PlotError(f"cannot read the run metrics in {run_dir}: {exc}") from None
    if not by_step:
        raise PlotError(f"{run_dir} has no step records (peer-*.jsonl)")
    curves = RunCurves(run_label(summary))
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    for i, step in enumerate(sorted(by_step)):
        records = by_step[step]
        curves.steps.append(step)
        curves.bytes_sent.append(mean(records, "bytes_sent"))
        curves.loss.append(mean(records, "loss"))
        curves.wall_s.append(max(r["wall_s"] for r in records))
        curves.bytes_per_step.append(mean(records, "_step_bytes"))
        evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
        if evals:
            curves.evals.append((i, evals[0]))
    final = summary.get("eval_loss_peer0")
    if final is not None and (not curves.evals or curves.evals[-1][0] != len(curves.steps) - 1):
        curves.evals.append((len(curves.steps) - 1, float(final)))  # the end-of-run eval
    return curves


def build_figure(run_dirs: Sequence[Path]) -> Figure:
    """The three-panel figure of these runs (and their baselines); PlotError if one cannot be read."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import EngFormatter
    except ImportError:
        raise PlotError("plotting needs matplotlib, which is not installed: pip install matplotlib") from None
    runs = [load_run(d) for d in expand_runs(run_dirs)]
    repeated = {r.label for r in runs if sum(o.label == r.label for o in runs) > 1}
    for run, d in zip(runs, expand_runs(run_dirs)):
        if run.label in repeated:
            run.label = f"{run.label} [{d}]"
    figure = Figure(figsize=(17, 4.8), layout="constrained")
    by_bytes, by_time, per_step = figure.subplots(1, 3)
    for n, run in enumerate(runs):
        colour = f"C{n % 10}"
        sent = [max(b, MIN_BYTES) for b in run.bytes_sent]
        by_bytes.plot(sent, run.loss, color=colour, label=run.label)
        by_time.plot(run.wall_s, run.loss, color=colour, label=run.label)
        per_step.plot(run.steps, run.bytes_per_step, color=colour, label=run.label, drawstyle="steps-mid")
        if run.evals:
            at, values = [i for i, _ in run.evals], [v for _, v in run.evals]
            by_bytes.plot([sent[i] for i in at], values, "o", color=colour, markeredgecolor="black")
            by_time.plot([run.wall_s[i] for i in at], values, "o", color=colour, markeredgecolor="black")
    by_bytes.set_xscale("log")
    by_bytes.xaxis.set_major_formatter(EngFormatter(unit="B"))
    by_bytes.set(xlabel=f"bytes sent per peer (log; 0 drawn at {MIN_BYTES:g} B)", ylabel="loss",
                 title="loss vs bytes sent")
    by_time.set(xlabel="wall time (s)", ylabel="loss", title="loss vs wall time")
    per_step.set_yscale("symlog", linthresh=MIN_BYTES)
    per_step.yaxis.set_major_formatter(EngFormatter(unit="B"))
    per_step.set(xlabel="step", ylabel="bytes sent per peer in the step", title="bytes per step")
    _legend(by_bytes, Line2D)
    per_step.legend(fontsize="small")
    return figure


def _legend(ax: Axes, line: Any) -> None:
    """Runs by colour, then what a line and a marker mean."""
    handles, _ = ax.get_legend_handles_labels()
    handles += [line([], [], color="grey", label="train loss (mean over peers)"),
                line([], [], color="grey", marker="o", markeredgecolor="black", linestyle="none",
                     label="eval loss (peer 0)")]
    ax.legend(handles=handles, fontsize="small")


def check_out(out_path: Path) -> str:
    """The format `out_path` asks for ("png" or "svg"); PlotError for any other suffix."""
    suffix = Path(out_path).suffix.lower()
    if suffix not in FORMATS:
        raise PlotError(f"--out must end in {' or '.join(FORMATS)}, got {str(out_path)!r}")
    return suffix[1:]


def write_plot(run_dirs: Sequence[Path], out_path: Path) -> Path:
    """Draw `run_dirs` (each with its baseline, if any) into `out_path`, PNG or SVG by its
    suffix, and return the path written. PlotError names what was wrong."""
    out_path = Path(out_path)
    fmt = check_out(out_path)
    figure = build_figure(run_dirs)
    try:
        figure.savefig(out_path, format=fmt, dpi=120)
    except OSError as exc:
        raise PlotError(f"cannot write {out_path}: {exc}") from None
    return out_path


def plot(
    dirs: List[Path] = typer.Argument(..., help="Run directories written by `starling simulate --out`."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="PNG or SVG to write, by its suffix (default: DIR/plot.png of the first run)."),
) -> None:
    """Draw loss against bytes sent (log axis) and against wall time, and bytes per step, for
    one or more runs."""
    try:
        typer.echo(str(write_plot(dirs, out or dirs[0] / "plot.png")))
    except PlotError as exc:
        fail(str(exc))
