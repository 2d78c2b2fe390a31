"""`starling simulate --processes P` against the same run in threads: the same summary, the same
files under --out, and (allreduce without churn repeats bit for bit) the same eval loss."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from starling.cli.main import app

runner = CliRunner()
RUN = ["simulate", "--protocol", "allreduce", "--task", "quadratic", "--task-opt", "dim=32", "--peers", "6",
       "--steps", "4", "--baseline", "none", "--json", "--no-plot"]


def simulate(out: Path, *extra: str) -> dict:
    result = runner.invoke(app, [*RUN, "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_six_peers_in_two_processes_match_the_threaded_run(tmp_path):
    threads = simulate(tmp_path / "threads", "--transport", "tcp")
    shards = simulate(tmp_path / "shards", "--processes", "2")
    assert shards.keys() == threads.keys()
    assert (threads["processes"], shards["processes"]) == (0, 2)
    assert shards["transport"] == "tcp"  # the default with processes
    assert shards["peer_status"] == threads["peer_status"] == {str(r): "finished" for r in range(6)}
    assert shards["eval_loss"] == threads["eval_loss"] and shards["train_loss"] == threads["train_loss"]
    # Protocol bytes differ only in header widths: sequence numbers grow with the heartbeats
    # sent while the workers start, and msgpack writes a larger number in more bytes.
    assert shards["bytes_sent_per_peer"] == pytest.approx(threads["bytes_sent_per_peer"], rel=0.01)
    records = {run: {rank: [json.loads(line) for line in (tmp_path / run / f"peer-{rank}.jsonl").read_text().splitlines()]
                     for rank in range(6)} for run in ("threads", "shards")}
    for rank in range(6):
        threaded, sharded = records["threads"][rank], records["shards"][rank]
        assert len(sharded) == len(threaded) == 4
        assert [r.keys() for r in sharded] == [r.keys() for r in threaded]
        assert [(r["step"], r["loss"]) for r in sharded] == [(r["step"], r["loss"]) for r in threaded]
    for run in ("threads", "shards"):
        assert sorted(p.name for p in (tmp_path / run).glob("peer-*.jsonl")) == [f"peer-{r}.jsonl" for r in range(6)]
        assert [p["status"] for p in json.loads((tmp_path / run / "peers.json").read_text())] == ["finished"] * 6
