"""A simulated run with a wall-clock budget (duration_s): every peer stops in time, leaves,
and still evaluates; and the peer-speed checks of SimConfig."""
from __future__ import annotations

import time

import pytest

from starling.runtime import SimConfig, Simulation


def test_a_wall_clock_budget_stops_every_peer_in_time_and_they_evaluate():
    config = SimConfig(peers=3, protocol="allreduce", task="quadratic", task_options={"dim": 16}, steps=10**6,
                       duration_s=1.5, peer_speed=(1.0, 1.0, 0.5), options={"round_timeout_s": 30.0})
    began = time.monotonic()
    result = Simulation(config).run()
    # a peer that stopped leaves at once: nobody waits out the 30 s round timeout for it
    assert time.monotonic() - began < 20
    assert result.summary["final_peers"] == 3 and result.summary["duration_s"] == 1.5
    assert all(p.eval_loss is not None and p.status == "finished" for p in result.peers)
    assert all(p.records[-1]["wall_s"] < 1.5 + 10 for p in result.peers)


@pytest.mark.parametrize("fields, message", [
    ({"peer_speed": (1.0,)}, "peer speeds name 1 peers, but there are 2"),
    ({"peer_speed": (1.0, 0.0)}, "peer speeds must be finite numbers > 0"),
    ({"duration_s": -1.0}, "duration_s must be"),
])
def test_bad_peer_speeds_and_budgets_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(peers=2, **fields)


def test_the_slowdown_is_relative_to_the_fastest_peer():
    config = SimConfig(peers=3, peer_speed=(2.0, 2.0, 0.5))
    assert [config.slowdown(r) for r in range(3)] == [1.0, 1.0, 4.0]
    assert config.slowdown(5) == 1.0  # a joiner runs at full speed
