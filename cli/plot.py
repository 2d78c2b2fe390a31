"""`starling plot`: loss versus bytes sent and versus wall time, from `simulate --out` runs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from starling.cli.shared import fail


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
