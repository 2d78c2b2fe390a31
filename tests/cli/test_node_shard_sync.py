"""`starling node start --nproc-per-replica N --shard-sync`: real replicas whose every rank is a
node of its own, syncing its shard with the same rank of the other replicas; a joining
replica's ranks find their sub-swarms through the signed records its seed's replica serves."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from cli_zygote import cli_popen, cli_run
from typer.testing import CliRunner

from starling.cli.main import app
from starling.runtime.shard_sync import fsdp_unavailable

TINY = ["--task-opt", "corpus_chars=60000", "--task-opt", "n_layer=1", "--task-opt", "n_embd=32",
        "--task-opt", "seq_len=32", "--task-opt", "batch_size=8", "--task-opt", "eval_batches=1"]
FAST = ["--plaintext", "--probe-interval-s", "0.2", "--suspicion-s", "6", "--log-every", "4"]
runner = CliRunner()


def starling(*args: str) -> list[str]:
    return [sys.executable, "-m", "starling.cli.main", "node", "start", *FAST, *args]


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(fsdp_unavailable() is not None, reason=f"FSDP2 on the CPU: {fsdp_unavailable()}")
def test_two_replicas_whose_ranks_each_sync_their_shard_end_with_the_same_model(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    first = cli_popen(starling("--protocol", "diloco", "--nproc-per-replica", "2", "--shard-sync",
                               "--steps", "12", "--opt", "sync_every=4", "--min-peers", "2", *TINY),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        address = None
        for line in first.stdout:  # type: ignore[union-attr]
            if "join with:" in line:
                address = line.rsplit("join with:", 1)[1].strip()
                break
            assert time.monotonic() < deadline, "no address"
        assert address is not None, first.stderr.read()[-3000:]  # type: ignore[union-attr]
        single = cli_run(starling("--join", address, "--steps", "4"), capture_output=True, text=True,
                         timeout=200, env=env)
        assert single.returncode != 0 and "replica_ranks: swarm has 2, this node has 1" in single.stderr
        second = cli_run(starling("--join", address, "--nproc-per-replica", "2", "--shard-sync",
                                  "--steps", "12"), capture_output=True, text=True, timeout=200, env=env)
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and second.returncode == 0, (err[-2000:], second.stderr[-2000:])
    mine, theirs = events(out), events(second.stdout)
    assert mine[0]["event"] == theirs[0]["event"] == "training"
    assert mine[0]["shard_rank"] == theirs[0]["shard_rank"] == 0  # rank 0 speaks for its replica on stdout
    assert any(e.get("peers") == 2 for e in mine[1:-1])
    # rank 1 of the joiner found rank 1 of the first replica through its signed records; a rank
    # that fetched a step before the other's fetched again ("fetching again")
    joined = [line.split(": joined from")[0].rsplit(" ", 1)[-1] for line in second.stderr.splitlines()
              if ": joined from" in line]
    assert len(set(joined)) == 2, second.stderr[-3000:]
    stopped, other = mine[-1], theirs[-1]
    assert stopped["event"] == other["event"] == "stopped"
    assert stopped["shard"]["swarm"] == other["shard"]["swarm"]  # sub-swarm 0 agreed on its chunks
    assert stopped["eval_loss"] == other["eval_loss"]  # the whole swarm model, evaluated through every rank


def test_shard_sync_without_ranks_is_one_clear_line():
    result = runner.invoke(app, ["node", "start", "--plaintext", "--protocol", "diloco", "--shard-sync"])
    assert result.exit_code != 0
    assert "--shard-sync splits a replica's model over its ranks" in result.output


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(fsdp_unavailable() is not None, reason=f"FSDP2 on the CPU: {fsdp_unavailable()}")
def test_a_replica_of_two_ranks_resumes_as_three_from_its_distributed_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = cli_run(starling("--protocol", "streaming-diloco", "--opt", "sync_every=2", "--opt", "fragments=2",
                             "--nproc-per-replica", "2", "--shard-sync", "--steps", "8", "--checkpoint-dir",
                             str(ckpt), "--checkpoint-every", "4", *TINY),
                    capture_output=True, text=True, timeout=200)
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000000004.dcp", "step-000000004.json",
                                                      "step-000000008.dcp", "step-000000008.json"]
    # what it trains comes from the checkpoint's manifest; three ranks now hold what two did
    again = cli_run(starling("--resume", str(ckpt), "--nproc-per-replica", "3", "--shard-sync",
                             "--steps", "10"), capture_output=True, text=True, timeout=200)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count("written by 2 ranks") == 3  # every rank resumed its chunks
    training, *_, stopped = events(again.stdout)
    assert training["step"] == 8 and training["protocol"] == "streaming-diloco" and stopped["step"] == 10
