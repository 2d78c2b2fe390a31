"""Smoke test of benchmarks/gossip.py: its main() on tiny settings, checking the rows' fields
(not timings or targets: those need the full run)."""
from __future__ import annotations

import json

import pytest
from conftest import bench_rows, load_benchmark

TINY_CHARLM = {"n_layer": 1, "n_head": 2, "n_embd": 16, "seq_len": 16, "batch_size": 4,
               "corpus_chars": 20_000, "eval_batches": 1}


def load_bench():
    return load_benchmark("gossip")


@pytest.mark.slow
@pytest.mark.timeout(600)  # three swarms and a fresh Python process on a busy 2-core box
def test_gossip_bench_bench_rows(capsys):
    bench = load_bench()
    assert bench.main(["--only", "charlm,mem", "--steps", "4", "--peers", "2", "--local-steps", "2",
                       "--task-options", json.dumps(TINY_CHARLM), "--peers-mem", "3",
                       "--mem-steps", "2", "--mem-deadline-s", "100"]) == 0
    got = bench_rows(capsys)

    runs = {r["protocol"]: r for r in got["run"]}
    assert set(runs) == {"allreduce", "gossip"}
    for run in runs.values():
        assert run["peers"] == 2 and run["steps"] == 4 and run["task_options"] == TINY_CHARLM
        assert run["eval_loss"] > 0 and run["bytes_per_peer"] > 0
    assert runs["gossip"]["options"]["local_steps"] == 2

    (charlm,) = got["charlm"]
    for key in ("allreduce_eval_loss", "gossip_eval_loss", "loss_gap", "allreduce_bytes_per_peer",
                "gossip_bytes_per_peer", "bytes_ratio", "allreduce_partial_peer_steps", "gossip_options"):
        assert key in charlm
    assert charlm["bytes_ratio"] == pytest.approx(charlm["gossip_bytes_per_peer"] / charlm["allreduce_bytes_per_peer"],
                                                  rel=1e-3)
    assert isinstance(charlm["loss_met"], bool) and isinstance(charlm["bytes_met"], bool)

    (mem,) = got["mem"]
    assert mem["ok"], mem
    assert mem["peers"] == 3 and mem["steps"] == 2 and mem["parameters"] == 1000
    assert mem["model_bytes_per_peer"] > 0 and mem["peak_rss"] >= mem["rss"]["base"] > 0
    assert set(mem["rss"]) == {"base", "nodes_started", "swarm_formed", "protocols", "trained"}
    assert mem["per_peer_beyond_model"] == pytest.approx(
        (mem["peak_rss"] - mem["rss"]["base"]) / 3 - mem["model_bytes_per_peer"], abs=2)
    assert isinstance(mem["met"], bool)
    (scaling,) = got["mem_scaling"]
    assert scaling["counts"] == [3] and isinstance(scaling["met"], bool)

    (summary,) = got["summary"]
    assert {"charlm_loss_met", "charlm_bytes_met", "mem_met", "benchmark_s"} <= set(summary)


def test_gossip_bench_mem_child_failure_is_reported(capsys, monkeypatch):
    """A memory process that dies comes back as a row saying so, not as an exception."""
    bench = load_bench()

    class Done:
        returncode, stdout, stderr = 1, "", "MemoryError\n"

    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: Done())
    assert bench.main(["--only", "mem", "--peers-mem", "2"]) == 0
    got = bench_rows(capsys)
    (mem,) = got["mem"]
    assert mem["ok"] is False and "exit code 1" in mem["error"] and "MemoryError" in mem["stderr_tail"]
    assert got["mem_scaling"][0]["met"] is False and got["summary"][0]["mem_met"] is False
