"""`starling simulate --nproc-per-replica N`: replicas of gloo ranks on this box, from the command line."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from starling.cli.main import app

runner = CliRunner()
TINY = ["--task-opt", "corpus_chars=60000", "--task-opt", "n_layer=1", "--task-opt", "n_embd=32",
        "--task-opt", "seq_len=32", "--task-opt", "batch_size=8", "--task-opt", "eval_batches=1"]


@pytest.mark.slow
def test_simulate_runs_replicas_of_two_gloo_ranks(tmp_path):
    result = runner.invoke(app, ["simulate", "--protocol", "streaming-diloco", "--peers", "2", "--steps", "8",
                                 "--nproc-per-replica", "2", "--baseline", "none", "--json", "--out", str(tmp_path),
                                 "--opt", "sync_every=4", *TINY])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["nproc_per_replica"] == 2 and summary["final_peers"] == 2
    digests = summary["protocol_info"]["replica"]["digests"]
    assert [d["rank"] for d in digests] == [0, 1] and digests[0]["model"] == digests[1]["model"]


@pytest.mark.parametrize("args, needle", [
    (["--protocol", "allreduce"], "does not take its inner steps alone"),
    (["--protocol", "diloco", "--processes", "2"], "replicas of many ranks run in their own processes; drop processes"),
    (["--protocol", "diloco", "--transport", "ipc"], "reach each other over tcp"),
])
def test_what_replicas_cannot_run_is_one_clear_line(args, needle):
    result = runner.invoke(app, ["simulate", "--peers", "2", "--steps", "2", "--nproc-per-replica", "2",
                                 "--baseline", "none", *args, *TINY])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and needle in lines[0], result.output


def test_node_start_with_replicas_needs_something_to_train():
    result = runner.invoke(app, ["node", "start", "--plaintext", "--nproc-per-replica", "2"])
    assert result.exit_code != 0 and "a replica of many ranks trains: give --protocol" in result.output
