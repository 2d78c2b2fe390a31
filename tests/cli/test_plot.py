"""`starling plot` and `write_plot`: three panels, bytes on a log axis, eval markers, legends
that name protocol and compressor, PNG or SVG by the suffix, one error line for anything else."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from starling.cli.main import app
from starling.cli.plot import PlotError, build_figure, write_plot

pytest.importorskip("matplotlib")

runner = CliRunner()
TINY = ["--task", "quadratic", "--task-opt", "dim=32", "--steps", "4", "--eval-every", "2", "--json"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two run directories: DiLoCo with fp16 and an all-reduce baseline beside it, and a single
    all-reduce peer, which sends nothing."""
    root = tmp_path_factory.mktemp("runs")
    fp16 = runner.invoke(app, ["simulate", *TINY, "--protocol", "diloco", "--sync-every", "2", "--compressor", "fp16",
                               "--peers", "2", "--out", str(root / "fp16")])
    assert fp16.exit_code == 0, fp16.output
    alone = runner.invoke(app, ["simulate", *TINY, "--protocol", "allreduce", "--peers", "1",
                                "--baseline", "none", "--out", str(root / "alone")])
    assert alone.exit_code == 0, alone.output
    assert json.loads(alone.output.splitlines()[-1])["bytes_sent_per_peer"] == 0
    return root / "fp16", root / "alone"


def test_the_figure_has_three_panels_and_bytes_on_a_log_axis(runs):
    figure = build_figure(list(runs))
    by_bytes, by_time, per_step = figure.axes
    assert len(figure.axes) == 3
    assert by_bytes.get_xscale() == "log"
    assert by_time.get_xscale() == "linear" and per_step.get_xlabel() == "step"
    # a run that sent nothing is drawn at 1 B instead of vanishing at log(0)
    # (the baseline beside the fp16 run has the same label, so both say which directory they are)
    alone = next(line for line in by_bytes.get_lines() if line.get_label() == f"allreduce (none) [{runs[1]}]")
    assert list(alone.get_xdata()) == [1.0] * 4


def test_the_legend_names_protocol_and_compressor_and_the_baseline(runs):
    figure = build_figure([runs[0]])
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert labels[:2] == ["diloco (fp16)", "allreduce (none)"]  # the run, then its baseline
    assert any("eval loss" in label for label in labels)


def test_eval_losses_are_markers_at_the_steps_peer_0_evaluated(runs):
    records = [json.loads(line) for line in (runs[0] / "peer-0.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2  # --eval-every 2 over 4 steps
    by_bytes = build_figure([runs[0]]).axes[0]
    markers = [line for line in by_bytes.get_lines() if line.get_marker() == "o" and len(line.get_ydata())]
    assert any(list(line.get_ydata()) == pytest.approx(evals) for line in markers)


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_plot_writes_png_or_svg_by_the_suffix(runs, tmp_path, suffix, magic):
    out = tmp_path / f"plot{suffix}"
    result = runner.invoke(app, ["plot", str(runs[0]), str(runs[1]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out)
    assert out.read_bytes()[:len(magic)] == magic
    if suffix == ".svg":
        assert b"<svg" in out.read_bytes()[:2000]


def test_write_plot_is_callable_without_the_cli(runs, tmp_path):
    assert write_plot([runs[1]], tmp_path / "alone.png") == tmp_path / "alone.png"
    with pytest.raises(PlotError, match="must end in .png or .svg"):
        write_plot([runs[1]], tmp_path / "alone.jpg")


def test_an_unknown_suffix_is_one_error_line_and_writes_nothing(runs, tmp_path):
    out = tmp_path / "plot.pdf"
    result = runner.invoke(app, ["plot", str(runs[0]), "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"starling: error: --out must end in .png or .svg, got '{out}'"]
    assert not out.exists()
