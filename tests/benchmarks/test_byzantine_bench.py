"""Smoke test of benchmarks/byzantine.py: its main() on short runs of one attack, checking the
rows' shape and the clearest verdict (a member that scales its gradient by 100 is banned by
every honest peer within a few rounds, and no honest peer is banned), not the other targets:
those need the full run."""
from __future__ import annotations

import math

import pytest
from conftest import bench_rows, load_benchmark

RUN_KEYS = {"protocol", "attack", "attackers", "attacker_ranks", "defences", "steps", "rounds", "eval_loss",
            "loss_vs_clean", "diverged", "bytes_per_peer", "s_per_round", "banned_attackers", "honest_banned",
            "honest_banned_kinds", "honest_cut_off", "trust_counts"}


@pytest.mark.slow
@pytest.mark.timeout(600)  # three swarms of 8 peers on a busy 2-core box
def test_byzantine_bench_rows_and_a_scaled_gradient_is_banned(capsys):
    bench = load_benchmark("byzantine")
    assert bench.main(["--quick", "--only", "scale", "--protocol", "allreduce", "--attackers", "1",
                       "--defences", "on", "--steps", "8"]) == 0
    got = bench_rows(capsys)

    runs = {(r["attack"], r["defences"]): r for r in got["run"]}
    assert set(runs) == {("none", "off"), ("none", "on"), ("scale", "on")}
    for run in runs.values():
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert run["protocol"] == "allreduce" and run["rounds"] == run["steps"] > 0
        assert math.isfinite(run["eval_loss"]) and run["bytes_per_peer"] > 0 and run["s_per_round"] > 0
        assert run["honest_banned"] == 0, run["honest_banned_kinds"]  # no honest peer is ever banned
    assert runs[("none", "off")]["loss_vs_clean"] == 1.0 and runs[("none", "off")]["attacker_ranks"] == []

    scaled = runs[("scale", "on")]
    assert scaled["attackers"] == 1 and len(scaled["attacker_ranks"]) == 1
    (ban,) = scaled["banned_attackers"]  # by every honest peer, early
    assert ban["rank"] == scaled["attacker_ranks"][0] and ban["rounds"] <= 6, ban
    assert ban["kind"] == "part.outlier"  # screened out round after round: two owners' word
    assert scaled["trust_counts"]["attackers"]["screened.norm_high"] > 0
    assert scaled["loss_vs_clean"] == pytest.approx(scaled["eval_loss"] / runs[("none", "off")]["eval_loss"])

    (cost,) = got["cost"]
    assert cost["bytes_ratio"] == pytest.approx(3.0, rel=0.02)  # three owners per shard: parts go out 3 times
    (targets,) = got["targets"]
    assert targets["honest_banned_met"] is True
    assert targets["undefended_harm_met"] is None  # no defences-off run of those attacks here
    assert isinstance(targets["defended_loss_met"], bool) and isinstance(targets["misses"], dict)
