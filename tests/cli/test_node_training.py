"""`starling node start --protocol ... --task ...`: real processes that train together; a
joiner that names nothing learns the protocol and task from the swarm and fetches its state."""
from __future__ import annotations

import inspect
import json
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from cli_zygote import cli_popen, cli_run
from typer.testing import CliRunner

from starling.cli.main import app
from starling.runtime.trainer import Trainer

FAST = ["--probe-interval-s", "0.2", "--suspicion-s", "6", "--plaintext"]
SNAPSHOT_EVERY_S = inspect.signature(Trainer).parameters["snapshot_every_s"].default


def starling(*args: str) -> list[str]:
    return [sys.executable, "-m", "starling.cli.main", *args]


class Lines:
    """Drains a process's stdout on a thread (a full pipe would stall the node), so the
    test can wait for the line it wants."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.queue.put(line) for line in proc.stdout], daemon=True).start()

    def address(self, timeout_s: float = 300) -> str:
        return self.text("join with:", timeout_s).rsplit("join with:", 1)[1].strip()

    def text(self, needle: str, timeout_s: float = 300) -> str:
        """The next line that contains `needle` (log lines too, when stderr is merged in)."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.queue.get(timeout=max(0.01, deadline - time.monotonic()))
            if needle in line:
                return line

    def until(self, pred, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.queue.get(timeout=max(0.01, deadline - time.monotonic()))
            if line.startswith("{"):
                record = json.loads(line)
                if pred(record):
                    return record


@pytest.mark.slow
@pytest.mark.timeout(600)  # two Python processes that import torch, on a loaded 2-core box
def test_a_joiner_learns_protocol_and_task_and_trains_with_the_swarm():
    common = ["--task", "quadratic", "--lr", "0.05", "--round-timeout-s", "5", "--log-every", "1"]
    first = cli_popen(starling("node", "start", *FAST, "--protocol", "allreduce", *common),
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    joiner = None
    try:
        out = Lines(first)
        address = out.address()
        assert out.until(lambda r: r.get("event") == "training")["protocol"] == "allreduce"
        # the state a joiner fetches is refreshed every SNAPSHOT_EVERY_S: a step that ended later
        # than that after training began refreshed it, so the joiner cannot fetch step 0's
        out.until(lambda r: r.get("step", 0) >= 3 and r.get("wall_s", 0) > SNAPSHOT_EVERY_S)
        # the joiner trains in bfloat16 on the first's float32 swarm: a peer's placement is its own
        joiner = cli_popen(starling("node", "start", *FAST, "--join", address, "--log-every", "1",
                                    "--device", "cpu", "--dtype", "bfloat16"),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        theirs = Lines(joiner)
        theirs.address()
        started = theirs.until(lambda r: r.get("event") == "training")
        assert (started["protocol"], started["task"]) == ("allreduce", "quadratic")
        assert (started["device"], started["dtype"], started["autocast"]) == ("cpu", "bfloat16", "none")
        assert started["step"] > 0  # it continued at the swarm's step, not from scratch
        synced = theirs.until(lambda r: r.get("peers") == 2)
        assert synced["bytes_sent"] > 0 and synced["lost"] == 0  # lost: members its update lacks
        for proc in (joiner, first):
            proc.send_signal(signal.SIGTERM)
        stopped = theirs.until(lambda r: r.get("event") == "stopped")
        assert stopped["eval_loss"] == stopped["eval_loss"]  # a number, not NaN
        assert joiner.wait(60) == 0 and first.wait(60) == 0
    finally:
        for proc in (first, joiner):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


runner = CliRunner()


@pytest.mark.parametrize("args, needle", [
    (["node", "start", "--plaintext", "--protocol", "nosuch"], "unknown protocol"),
    (["node", "start", "--plaintext", "--protocol", "gossip", "--topology", "moebius"], "topology"),
    (["node", "start", "--plaintext", "--protocol", "gossip", "--no-such-option", "1"], "no_such_option"),
    (["node", "start", "--plaintext", "--protocol", "gossip", "--shard", "3/2"], "--shard"),
    (["node", "start", "--plaintext", "--task", "quadratic"], "--protocol"),
    (["node", "start", "--plaintext", "--protocol", "diloco", "--device", "tpu"], "unknown device 'tpu'"),
    (["node", "start", "--plaintext", "--protocol", "diloco", "--dtype", "int8"], "float32, bfloat16 or float16"),
    (["node", "start", "--plaintext", "--protocol", "diloco", "--autocast", "float16"], "loss scaling"),
    (["node", "start", "--no-listen"], "--no-listen needs --join"),
    (["node", "start", "--join-deadline-s", "0", "--join", "tcp://127.0.0.1:1"], "--join-deadline-s"),
    (["simulate", "--steps", "2", "--fanout", "zero"], "fanout"),
    (["simulate", "--steps", "2", "stray"], "unexpected argument"),
])
def test_bad_training_arguments_are_one_clear_line(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("starling: error:") and needle in lines[0], result.output


def test_protocols_lists_every_protocol_and_its_hyper_parameters():
    from starling.protocols import registered_protocols

    listing = runner.invoke(app, ["protocols"])
    assert listing.exit_code == 0
    assert all(name in listing.output for name in registered_protocols())
    options = runner.invoke(app, ["protocols", "gossip"])
    assert options.exit_code == 0 and "--topology" in options.output and "'complete'" in options.output
    assert runner.invoke(app, ["protocols", "nosuch"]).exit_code != 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_joiner_whose_copy_of_the_swarms_data_is_missing_is_one_line_and_exit_2(text_corpus, tmp_path, monkeypatch):
    # the first node names its corpus relative to its own folder; the swarm's config holds it absolute
    monkeypatch.chdir(text_corpus.parent)
    first = cli_popen(starling("node", "start", *FAST, "--protocol", "allreduce", "--data", text_corpus.name,
                               "--seq-len", "16", "--round-timeout-s", "5", "--log-every", "1"),
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        out = Lines(first)
        address = out.address()
        out.until(lambda r: r.get("event") == "training")
        text_corpus.rename(tmp_path / "moved")  # the joiner's machine has no copy where the config says
        joiner = cli_run(starling("node", "start", *FAST, "--join", address), capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
        lines = [line for line in joiner.stderr.splitlines() if line.strip() and not line.startswith("20")]
        assert joiner.returncode == 2, joiner.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith("starling: error:"), lines
        assert str(text_corpus) in lines[0]  # absolute: not read as a hub data set's name
    finally:
        first.kill()
        first.wait(10)
