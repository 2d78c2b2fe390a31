"""`starling node start --nproc-per-replica N`: real replicas of gloo ranks that train together,
a replica of another size (a single process too) refused at its hello, and the rendezvous
folder of spawned ranks removed on every way out."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_zygote import cli_popen, cli_run

from starling.node.client import query

TINY = ["--task-opt", "corpus_chars=60000", "--task-opt", "n_layer=1", "--task-opt", "n_embd=32",
        "--task-opt", "seq_len=32", "--task-opt", "batch_size=8", "--task-opt", "eval_batches=1"]
FAST = ["--plaintext", "--probe-interval-s", "0.2", "--suspicion-s", "6", "--log-every", "4"]


def starling(*args: str) -> list[str]:
    return [sys.executable, "-m", "starling.cli.main", "node", "start", *FAST, *args]


def address_of(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:  # type: ignore[union-attr]
        if "join with:" in line:
            return line.rsplit("join with:", 1)[1].strip()
        assert time.monotonic() < deadline, "no address"
    raise AssertionError("the first node exited before it listened")


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def leftover_rendezvous(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("starling-replica-"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_replicas_of_two_ranks_train_together_and_other_sizes_are_refused_at_hello(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where each replica's rendezvous folder goes
    first = cli_popen(starling("--protocol", "streaming-diloco", "--nproc-per-replica", "2", "--steps", "8",
                               "--opt", "sync_every=4", "--min-peers", "2", "--shard", "0/2", *TINY),
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        address = address_of(first)
        # a single process: refused at hello, never a member
        refused = cli_run(starling("--join", address, "--steps", "8"), capture_output=True, text=True,
                          timeout=200, env=env)
        assert refused.returncode != 0
        assert "replica_ranks: swarm has 2, this node has 1" in refused.stderr, refused.stderr[-2000:]
        assert "training" not in refused.stdout
        # a replica of 3: told so by the seed's status before it starts its ranks (its hello would
        # refuse it too: tests/runtime/test_replicas.py)
        bigger = cli_run(starling("--join", address, "--nproc-per-replica", "3", "--steps", "8"),
                         capture_output=True, text=True, timeout=200, env=env)
        assert bigger.returncode != 0
        assert (f"replica_ranks: swarm has 2, this node has 3 (asked {address} before starting this replica's "
                "ranks)") in bigger.stderr, bigger.stderr[-2000:]
        assert "training" not in bigger.stdout
        assert query(address, timeout_s=30)["peers"] == []  # nobody counted toward --min-peers: the first still waits
        assert first.poll() is None
        second = cli_run(starling("--join", address, "--nproc-per-replica", "2", "--steps", "8",
                                  "--shard", "1/2"), capture_output=True, text=True, timeout=200, env=env)
        out, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and second.returncode == 0, second.stderr[-2000:]
    mine, theirs = events(out), events(second.stdout)
    assert mine[0]["event"] == theirs[0]["event"] == "training" and mine[0]["replica_ranks"] == 2
    assert {mine[0]["shard"], theirs[0]["shard"]} == {"0/4", "2/4"}  # rank 1 of each replica takes 1/4 and 3/4
    assert any(e.get("peers") == 2 for e in mine[1:-1])
    # the same outer parameters on both replicas: the same eval loss
    assert mine[-1]["event"] == theirs[-1]["event"] == "stopped" and mine[-1]["eval_loss"] == theirs[-1]["eval_loss"]
    for stopped in (mine[-1], theirs[-1]):  # each replica's ranks end holding the same model
        assert stopped["replica"]["ranks"] == 2 and stopped["replica"]["agree"], stopped
        assert stopped["replica"]["step"] == 8
    assert leftover_rendezvous(tmp_path) == []  # after a run and after a refusal


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replica_stopped_by_sigterm_leaves_no_rendezvous_folder(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    waiting = cli_popen(starling("--protocol", "streaming-diloco", "--nproc-per-replica", "2",
                                 "--min-peers", "2", *TINY),
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        address_of(waiting)  # up, with its ranks spawned, waiting for a second peer
        assert leftover_rendezvous(tmp_path)
        waiting.send_signal(signal.SIGTERM)
        waiting.wait(timeout=60)
    finally:
        waiting.kill()
    assert leftover_rendezvous(tmp_path) == []
    early = cli_popen(starling("--protocol", "streaming-diloco", "--nproc-per-replica", "2",
                               "--join", "tcp://127.0.0.1:9", "--join-deadline-s", "600", *TINY),
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:  # SIGTERM while it still tries to join (before its node is up)
        deadline = time.monotonic() + 60
        while not leftover_rendezvous(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leftover_rendezvous(tmp_path)
        early.send_signal(signal.SIGTERM)
        assert early.wait(timeout=60) != 0
    finally:
        early.kill()
    assert leftover_rendezvous(tmp_path) == []
