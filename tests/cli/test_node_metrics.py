"""`starling node start --metrics-port`: a Prometheus scrape of a training node names every
metric it documents, and their values move as the swarm trains, loses a peer and checkpoints."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from cli_zygote import cli_popen
from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_node_training import FAST, Lines, starling
from typer.testing import CliRunner

from starling.cli.main import app
from starling.node.client import query

EXPECTED = {  # what an operator watches: steps, loss, bytes per topic and peer, peers by status, rounds completed and
    # closed without someone, stall seconds, rejected frames by reason, checkpoint age, what the node holds against
    # its peers
    "starling_steps", "starling_step", "starling_loss", "starling_bytes_sent", "starling_bytes_received",
    "starling_peers", "starling_rounds", "starling_rounds_incomplete", "starling_stall_seconds",
    "starling_rejected_frames", "starling_checkpoint_age_seconds", "starling_node_info",
    "starling_peer_contributions", "starling_banned_peers", "starling_peer_banned",
}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of one scrape, as {(name, sorted labels): value}, and the family names under
    (name, ()) -> family name (counters lose their _total in the family name)."""
    with urllib.request.urlopen(url, timeout=30) as answer:
        text = answer.read().decode()
    samples: dict = {}
    for family in text_string_to_metric_families(text):
        samples[("family", (family.name,))] = 1.0
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def families(samples: dict) -> set[str]:
    return {key[1][0] for key in samples if key[0] == "family"}


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def _stop(procs: list) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(600)  # two Python processes that import torch, on a loaded 2-core box
def test_a_scrape_names_every_metric_and_the_values_move_as_the_swarm_trains(tmp_path):
    train = ["--task", "quadratic", "--lr", "0.05", "--round-timeout-s", "5", "--log-every", "10"]
    first = cli_popen(starling("node", "start", *FAST, "--protocol", "allreduce", *train, "--metrics-port", "0",
                               "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "20",
                               "--probe-timeout-s", "1",
                               # dead well after a round gives up on a silent member (5 s): a first
                               # node starved on a loaded box for the whole dead-after time would
                               # see the stopped peer dead before any round waited for it
                               "--suspicion-s", "12"),
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    joiner = None
    try:
        out = Lines(first)
        address = out.address()
        url = out.text("starling metrics on").rsplit(" ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        joiner = cli_popen(starling("node", "start", *FAST, "--join", address, "--log-every", "10"),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        Lines(joiner)  # drained, so a full pipe never stalls it
        out.until(lambda r: r.get("peers") == 2)  # the first trains with the joiner: rounds complete

        before = scrape(url)
        assert EXPECTED <= families(before), EXPECTED - families(before)
        assert total(before, "starling_peers", status="alive") == 1
        joiner_ids = {dict(ls)["peer"] for (n, ls) in before if n == "starling_bytes_sent_total"} - {"<strangers>"}
        assert len(joiner_ids) == 1, joiner_ids  # the joiner is the one member with a label of its own
        (joiner_id,) = joiner_ids
        assert total(before, "starling_bytes_sent_total", peer=joiner_id) > 0
        assert total(before, "starling_rounds_total") > 0
        assert total(before, "starling_banned_peers") == 0  # an honest swarm bans no one
        info = [dict(ls) for (n, ls) in before if n == "starling_node_info"]
        assert info and info[0]["protocol"] == "allreduce" and info[0]["task"] == "quadratic"

        moved: dict = {}

        def grew() -> bool:
            moved.update(scrape(url))
            return all(total(moved, name) > total(before, name) for name in
                       ("starling_steps_total", "starling_step", "starling_bytes_sent_total",
                        "starling_bytes_received_total", "starling_rounds_total"))

        assert wait_until(grew, timeout_s=120, interval_s=0.2), moved
        assert total(moved, "starling_checkpoint_age_seconds") >= 0
        assert total(moved, "starling_checkpoint_step") >= 20

        # what node watch shows of a peer: training publishes step, loss and last sync in the heartbeat meta
        def joiner_meta() -> dict:
            peers = {p["id"]: p for p in query(address, timeout_s=10)["peers"]}
            return peers[joiner_id]["meta"]

        assert wait_until(lambda: {"step", "loss", "synced"} <= set(joiner_meta()), timeout_s=60)
        assert joiner_meta()["step"] > 0 and joiner_meta()["synced"] > time.time() - 600

        # a peer that stops answering mid-round: the first's round goes on without it, and the table
        # says dead. SIGSTOP, not SIGKILL: a killed peer's closed connection may be noticed between two
        # rounds, and then no round ever waited for it; a stopped one is waited for by the next round.
        joiner.send_signal(signal.SIGSTOP)
        gone: dict = {}

        def went_on_without_it() -> bool:
            gone.update(scrape(url))
            return (total(gone, "starling_rounds_incomplete_total") >= 1
                    and total(gone, "starling_peers", status="dead") == 1)

        assert wait_until(went_on_without_it, timeout_s=120, interval_s=0.2), {
            name: total(gone, name) for name in ("starling_rounds_total", "starling_rounds_incomplete_total",
                                                 "starling_steps_total")} | {
            status: total(gone, "starling_peers", status=status) for status in ("alive", "suspect", "dead", "left")}
        joiner.kill()
        joiner.wait(30)
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0
    finally:
        _stop([first, joiner])


runner = CliRunner()


def _one_error_line(result) -> str:
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("starling: error:"), result.output
    return lines[0]


def test_a_port_out_of_range_is_one_error_line():
    assert "--metrics-port" in _one_error_line(runner.invoke(app, ["node", "start", "--plaintext",
                                                                   "--metrics-port", "70000"]))


def test_a_port_in_use_is_one_error_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_error_line(runner.invoke(app, ["node", "start", "--plaintext", "--metrics-port", str(port)]))
    assert f"cannot serve metrics on 127.0.0.1:{port}" in line


def test_tensorboard_without_its_package_says_which_extra_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # an import of it now fails
    line = _one_error_line(runner.invoke(app, ["node", "start", "--plaintext", "--tensorboard", str(tmp_path)]))
    assert "starling[tensorboard]" in line
