"""`starling simulate` and `starling plot` in-process: JSON summary, output files, the baseline
table, and one-line errors for bad input."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from starling.cli.main import app
from starling.protocols.base import Protocol, ProtocolConfig, StepReport, register, registered_protocols

runner = CliRunner()


@dataclass(frozen=True)
class QuietConfig(ProtocolConfig):
    lr: float = 0.1
    note: str = ""  # a protocol-specific option the baseline does not know


class QuietSGD(Protocol):
    """Test-only local SGD that never sends anything."""

    name = "test-quiet"
    config_class = QuietConfig

    def step(self, loss_fn) -> StepReport:
        loss = loss_fn()
        self.model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in self.model.parameters():
                p -= self.config.lr * p.grad
        self.step_count += 1
        return StepReport(step=self.step_count, loss=loss.item())


if "test-quiet" not in registered_protocols():
    register(QuietSGD)

TINY = ["--protocol", "test-quiet", "--task", "quadratic", "--task-opt", "dim=32", "--peers", "2", "--steps", "3"]
FIELDS = ("protocol", "peers", "steps", "task", "train_loss", "eval_loss", "bytes_sent_per_peer", "wall_s")


def test_json_summary_has_the_documented_fields():
    result = runner.invoke(app, ["simulate", *TINY, "--json", "--baseline", "none", "--lr", "0.2",
                                 "--opt", "note=hello"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    for key in FIELDS:
        assert key in summary, key
    assert (summary["protocol"], summary["peers"], summary["steps"], summary["task"]) == ("test-quiet", 2, 3, "quadratic")
    assert summary["bytes_sent_per_peer"] == 0 and "baseline" not in summary
    assert summary["options"] == {"note": "hello", "lr": 0.2} and summary["task_options"] == {"dim": "32"}


@pytest.mark.slow
def test_baseline_runs_with_the_same_task_and_steps_and_files_are_written(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["simulate", *TINY, "--json", "--baseline", "allreduce", "--opt", "note=x",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    base = summary["baseline"]
    for key in FIELDS:
        assert key in base, key
    assert (base["protocol"], base["task"], base["steps"], base["peers"]) == ("allreduce", "quadratic", 3, 2)
    # the run's lr (its default, 0.1), not "note" (not an allreduce option)
    assert base["bytes_sent_per_peer"] > 0 and base["options"] == {"lr": 0.1}
    assert json.loads((out / "summary.json").read_text()) == summary
    assert len((out / "peer-0.jsonl").read_text().splitlines()) == 3
    assert json.loads((out / "baseline" / "summary.json").read_text())["protocol"] == "allreduce"
    assert (out / "baseline" / "peer-1.jsonl").is_file()

    table = runner.invoke(app, ["simulate", *TINY, "--baseline", "allreduce"])
    assert table.exit_code == 0, table.output
    assert "test-quiet" in table.stdout and "allreduce" in table.stdout and "vs baseline" in table.stdout
    assert "none sent" in table.stdout  # test-quiet sends nothing


def test_table_run_writes_its_run_and_plot_and_says_where():
    """Without --out or --json, the run and its plot land in a fresh runs/simulate-* directory
    (tests/conftest.py gives every CLI test its own cwd), and the last line names both."""
    pytest.importorskip("matplotlib")
    from starling.cli.plot import build_figure

    result = runner.invoke(app, ["simulate", "--protocol", "allreduce", "--task", "quadratic", "--peers", "2",
                                 "--steps", "3", "--baseline", "none"])
    assert result.exit_code == 0, result.output
    runs = Path("runs").resolve()
    (run_dir,) = runs.iterdir()
    assert run_dir.name.startswith("simulate-") and (run_dir / "summary.json").is_file()
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last = result.stdout.strip().splitlines()[-1]
    assert last == f"run written to runs/{run_dir.name}; plot: runs/{run_dir.name}/plot.png"
    assert build_figure([run_dir]).axes[0].get_xscale() == "log"
    again = runner.invoke(app, ["simulate", "--protocol", "allreduce", "--task", "quadratic", "--peers", "2",
                                "--steps", "2", "--baseline", "none", "--no-plot"])
    assert again.exit_code == 0, again.output
    assert len(list(runs.iterdir())) == 2  # a second run in the same second gets its own
    assert "plot:" not in again.stdout


def test_json_run_writes_nothing_unless_asked():
    result = runner.invoke(app, ["simulate", *TINY, "--baseline", "none", "--json"])
    assert result.exit_code == 0, result.output
    assert not Path("runs").exists()


@pytest.mark.parametrize("args, needle", [
    (["--protocol", "no-such-protocol"], "unknown protocol"),
    (["--baseline", "no-such-protocol"], "unknown protocol"),
    (["--task", "no-such-task"], "unknown task"),
    (["--bandwidth", "fast"], "bandwidth"),
    (["--churn", "kill@3"], "churn"),
    (["--churn", "kill:7@1"], "ranks run"),
    (["--peers", "0"], "peers"),
    (["--loss", "1.5"], "--loss"),
    (["--latency", "-3"], "--latency"),
    (["--opt", "novalue"], "NAME=VALUE"),
    (["--opt", "bogus=1"], "bogus"),
    (["--task-opt", "dim=many"], "dim"),
    (["--transport", "udp"], "transport"),
    (["--processes", "2", "--transport", "inproc"], "processes"),
    (["--processes", "-1"], "processes must be a whole number from 0"),
    (["--processes", "3"], "processes must be a whole number from 0 (threads in this process) to peers (2), got 3"),
    (["--processes", "two"], "Invalid value for '--processes'"),
    (["--processes"], "--processes"),  # it takes a count now
    (["--device", "tpu"], "unknown device 'tpu'; choose cpu | cuda | cuda:N | mps | auto"),
    (["--dtype", "int8"], "choose float32, bfloat16 or float16"),
    (["--autocast", "fp16"], "loss scaling"),
    (["--state-device", "gpu"], "unknown device 'gpu'"),
    (["--resume"], "resume needs a checkpoint_dir"),
])
def test_bad_input_is_one_clear_line(args, needle):
    result = runner.invoke(app, ["simulate", *TINY, "--baseline", "none", *args])
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("starling: error:") and needle in lines[0], result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_device_this_machine_lacks_is_one_clear_line():
    result = runner.invoke(app, ["simulate", *TINY, "--baseline", "none", "--device", "cuda:1"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "starling: error: device 'cuda:1': this machine has no CUDA device" in result.output


RESTART = ["--protocol", "allreduce", "--task", "quadratic", "--task-opt", "dim=32", "--task-opt", "noise_std=0.1",
           "--peers", "2", "--json", "--checkpoint-every", "4"]


def test_simulate_checkpoints_and_resumes_where_it_stopped(tmp_path):
    """Run 4 steps with checkpoints, resume to 8: the same summary as 8 steps in one go (the
    baseline's checkpoints go to their own folder)."""
    whole = runner.invoke(app, ["simulate", *RESTART, "--steps", "8", "--baseline", "none"])
    first = runner.invoke(app, ["simulate", *RESTART, "--steps", "4", "--baseline", "gossip",
                                "--checkpoint-dir", str(tmp_path)])
    assert first.exit_code == 0, first.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["baseline", "peer-0", "peer-1"]
    assert (tmp_path / "baseline" / "peer-0").is_dir()
    resumed = runner.invoke(app, ["simulate", *RESTART, "--steps", "8", "--baseline", "none",
                                  "--checkpoint-dir", str(tmp_path), "--resume", "--out", str(tmp_path / "out")])
    assert resumed.exit_code == 0, resumed.output
    for rank in (0, 1):  # both went on from step 4: they trained 4 steps, not 8
        steps = [json.loads(line)["step"] for line in (tmp_path / "out" / f"peer-{rank}.jsonl").open()]
        assert steps == [4, 5, 6, 7]
    a, b = (json.loads(r.output.splitlines()[-1]) for r in (whole, resumed))
    assert b["checkpoint_dir"] == str(tmp_path) and b["resume"] is True
    assert b["eval_loss"] == a["eval_loss"] and b["train_loss"] == a["train_loss"]


def test_simulate_places_the_models_in_bfloat16():
    result = runner.invoke(app, ["simulate", "--protocol", "diloco", "--task", "quadratic", "--task-opt", "dim=32",
                                 "--peers", "2", "--steps", "4", "--sync-every", "2", "--json", "--baseline", "none",
                                 "--dtype", "bfloat16", "--device", "cpu", "--state-device", "cpu"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.splitlines()[-1])
    assert summary["placement"] == {"device": "cpu", "dtype": "bfloat16", "autocast": "none", "state_device": "cpu"}
    assert summary["eval_loss"] is not None


def test_plot_needs_a_run_directory(tmp_path):
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    needle = "pip install matplotlib" if importlib.util.find_spec("matplotlib") is None else "summary.json"
    assert needle in result.output


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_plot_draws_a_png_of_runs(tmp_path):
    assert runner.invoke(app, ["simulate", *TINY, "--json", "--baseline", "none", "--out", str(tmp_path / "a")]).exit_code == 0
    result = runner.invoke(app, ["plot", str(tmp_path / "a"), "--out", str(tmp_path / "p.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_bytes_ratio_reads_as_a_person_says_it():
    from starling.cli.simulate import bytes_ratio

    assert bytes_ratio(1, 671) == "671x fewer"
    assert bytes_ratio(133, 100) == "1.33x more"
    assert bytes_ratio(50, 100) == "2x fewer"
    assert bytes_ratio(100, 100) == "same" and bytes_ratio(0, 100) == "none sent" and bytes_ratio(5, 0) == "-"


@pytest.mark.slow
def test_the_default_job_shows_streaming_diloco_sending_far_fewer_bytes_than_a_fair_baseline():
    """The main job's defaults, shortened to 40 steps (one sync of every fragment)."""
    result = runner.invoke(app, ["simulate", "--steps", "40", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.splitlines()[-1])
    base = summary["baseline"]
    assert summary["protocol"] == "streaming-diloco" and base["protocol"] == "allreduce"
    run_config, base_config = summary["protocol_info"]["config"], base["protocol_info"]["config"]
    assert (run_config["inner_optimizer"], run_config["lr"]) == ("adamw", 3e-3)  # tuned for charlm
    assert (base_config["optimizer"], base_config["lr"]) == ("adamw", 3e-3)  # the run's: a fair baseline
    assert 0 < summary["bytes_sent_per_peer"] < base["bytes_sent_per_peer"] / 20


def test_defences_are_options_of_the_reducing_protocols_and_bad_ones_are_one_clear_line():
    """`--aggregator` and `--owner-replication` reach allreduce's reducer: three owners per shard
    send each part three times, and a robust aggregator on honest peers trains as the mean does."""
    base = ["simulate", "--protocol", "allreduce", "--task", "quadratic", "--task-opt", "dim=64", "--peers", "4",
            "--steps", "4", "--baseline", "none", "--json"]
    runs = {}
    for name, extra in {"mean": [], "robust": ["--aggregator", "centered_clip", "--owner-replication", "3"]}.items():
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 0, result.output
        runs[name] = json.loads(result.stdout)
    assert runs["robust"]["protocol_info"]["config"]["owner_replication"] == 3
    # each part three times; on a 64-value task a part's header (signature, view, the vote's
    # digest) weighs as much as its values, so the ratio sits a little above 3 (3.54 measured)
    assert 2.5 < runs["robust"]["bytes_sent_per_peer"] / runs["mean"]["bytes_sent_per_peer"] < 4.0
    assert abs(runs["robust"]["eval_loss"] / runs["mean"]["eval_loss"] - 1.0) < 0.01
    for args, needle in ((["--aggregator", "krum"], "unknown aggregator 'krum'"),
                         (["--owner-replication", "5"], "owner_replication must be 1, 2 or 3")):
        result = runner.invoke(app, [*base, *args])
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code != 0 and len(lines) == 1 and needle in lines[0], result.output
