"""benchmarks/async_readme.py: the documented command (docs/cli.md) and its baseline, and the rows it prints,
on hand-made summaries (the runs need the benchmark)."""
from __future__ import annotations

import pytest
from conftest import load_benchmark

from starling.cli.simulate import _sim_configs
from starling.protocols import config_from_options
from starling.runtime import resolve_protocol
from starling.runtime.simconfig import DEFAULT_SIM_STEPS, UNCAPPED_STEPS


def load_bench():
    return load_benchmark("async_readme")


def test_the_runs_are_the_readme_command_and_the_same_with_the_overlap_fixed_at_tau():
    bench = load_bench()
    mine, base = bench.command(40, None, False), bench.command(40, None, True)
    assert mine[:mine.index("--baseline")] == ["simulate", "--peer-speed", "1,1,1,0.33", "--opt", "sync_every_s=2",
                                                "--opt", "quorum=3", "--duration", "40"]
    assert [a for a in base if a not in mine] == ["overlap_window_share=0"]
    # the documented command runs streaming-diloco, whose rounds follow the window
    opts = [mine[i + 1] for i, a in enumerate(mine) if a == "--opt"]
    config, _ = _sim_configs(peers=4, protocol="streaming-diloco", task="charlm", steps=None, compressor=None,
                             transport=None, processes=0, bandwidth=None, latency_ms=0.0, loss=0.0, churn=None,
                             seed=0, opt=opts, lr=None, task_opt=[], eval_every=0, baseline="none",
                             extra={"duration_s": 40.0})
    assert config.steps == UNCAPPED_STEPS  # --duration without --steps: peers train until the time is up
    run = config_from_options(resolve_protocol(config.protocol).config_class, config.protocol_options())
    assert run.sync_every_s == 2 and run.quorum == 3 and run.overlap_window_share == 0.5 and run.overlap_steps == 1


def test_rows_take_the_fast_peers_lowest_busy_share_and_the_summary_the_ratio():
    bench = load_bench()
    summary = {"peer_speed": [1.0, 1.0, 1.0, 0.33], "busy_share": {"0": 0.93, "1": 0.91, "2": 0.95, "3": 0.6},
               "eval_loss": 1.8, "wall_s": 40.0, "protocol_info": {"overlap_now": 6}}
    mine = bench.describe("readme", ["simulate"], summary, {0: 900, 1: 900, 2: 900, 3: 300})
    assert mine["fast_busy"] == 0.91 and mine["overlap_now_peer0"] == 6
    base = bench.describe("tau only", ["simulate"], {**summary, "busy_share": {"0": 0.7, "1": 0.65, "2": 0.8,
                                                                                "3": 0.9}, "eval_loss": 1.9}, {})
    row = bench.summarize([mine, base])
    assert row["fast_busy"] == 0.91 and row["baseline_fast_busy"] == 0.65
    assert row["ratio"] == pytest.approx(0.91 / 0.65) and row["target_met"]
    assert row["eval_loss"] == 1.8 and row["baseline_eval_loss"] == 1.9


def test_steps_default_to_200_without_a_duration_and_sketch_dp_needs_them_with_one():
    common = dict(task="teacher", compressor=None, transport=None, processes=0, bandwidth=None, latency_ms=0.0,
                  loss=0.0, churn=None, seed=0, opt=[], lr=None, task_opt=[], eval_every=0, baseline="none")
    config, _ = _sim_configs(peers=2, protocol="allreduce", steps=None, **common)
    assert config.steps == DEFAULT_SIM_STEPS
    with pytest.raises(ValueError, match="needs --steps"):
        _sim_configs(peers=2, protocol="sketch-dp", steps=None, extra={"duration_s": 10.0}, **common)
    config, _ = _sim_configs(peers=2, protocol="sketch-dp", steps=50, extra={"duration_s": 10.0}, **common)
    assert config.steps == 50
