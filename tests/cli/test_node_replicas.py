"""`starling node start --nproc-per-replica N`: real replicas of gloo ranks that train together,
and a replica of another size refused at its hello."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

TINY = ["--task-opt", "corpus_chars=60000", "--task-opt", "n_layer=1", "--task-opt", "n_embd=32",
        "--task-opt", "seq_len=32", "--task-opt", "batch_size=8", "--task-opt", "eval_batches=1"]
FAST = ["--plaintext", "--heartbeat-s", "0.2", "--suspect-after-s", "3", "--dead-after-s", "6", "--log-every", "4"]


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_replicas_of_two_ranks_train_together_and_a_replica_of_three_is_refused():
    first = subprocess.Popen(starling("--protocol", "streaming-diloco", "--nproc-per-replica", "2", "--steps", "8",
                                      "--opt", "sync_every=4", "--min-peers", "2", "--shard", "0/2", *TINY),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = address_of(first)
        refused = subprocess.run(starling("--join", address, "--nproc-per-replica", "3", "--steps", "8"),
                                 capture_output=True, text=True, timeout=200)
        assert refused.returncode != 0
        assert "replica_ranks: swarm has 2, this node has 3" in refused.stderr, refused.stderr[-2000:]
        second = subprocess.run(starling("--join", address, "--nproc-per-replica", "2", "--steps", "8",
                                         "--shard", "1/2"), capture_output=True, text=True, timeout=200)
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
