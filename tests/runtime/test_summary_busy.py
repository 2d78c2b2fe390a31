"""The simulate summary's busy share: per peer, the sum of its steps' compute over the sum of
their wall time (a long step weighs by its length), for every protocol, with one line for people."""
from __future__ import annotations

import pytest

from starling.runtime import PeerResult, SimConfig, Simulation, busy_note, busy_share, summarize


def records(*steps: tuple[float, float]) -> list[dict]:
    return [{"loss": 1.0, "compute_s": compute, "step_wall_s": wall} for compute, wall in steps]


def test_busy_is_the_sum_of_compute_over_the_sum_of_wall_time_not_a_mean_of_ratios():
    # a short idle step and a long busy one: 1.0 / 1.1, where the mean of ratios would say 0.5
    assert busy_share(records((0.0, 0.1), (1.0, 1.0))) == pytest.approx(1.0 / 1.1)
    assert busy_share(records((0.05, 0.1), (0.05, 0.1))) == pytest.approx(0.5)
    assert busy_share([]) is None and busy_share(records((0.0, 0.0))) is None


def test_the_summary_reports_each_peers_busy_share_by_rank():
    config = SimConfig(peers=3, protocol="allreduce", task="quadratic", steps=2, peer_speed=(1.0, 1.0, 0.5))
    peers = [PeerResult(0, "a", status="finished", records=records((0.09, 0.1), (0.07, 0.1)), train_end=1.0),
             PeerResult(1, "b", status="finished", records=records((0.3, 0.4)), train_end=1.0),
             PeerResult(2, "c", status="killed", train_end=1.0)]
    summary = summarize(config, peers, t0=0.0)
    assert summary["busy_share"] == {"0": pytest.approx(0.8), "1": pytest.approx(0.75), "2": None}
    assert busy_note(summary) == "busy (compute over step wall time), by peer: 0 80.0% (speed 1), 1 75.0% (speed 1)"
    assert busy_note({**summary, "peer_speed": []}).endswith("by peer: 0 80.0%, 1 75.0%")
    assert busy_note({**summary, "busy_share": {"0": None}}) is None
    many = {"busy_share": {str(rank): (rank % 7) / 10 for rank in range(100)}, "peer_speed": []}
    assert busy_note(many) == ("busy (compute over step wall time), over 100 peers: least peer 0 0.0%, median 30.0%, "
                               "most peer 97 60.0% (summary.json's busy_share has each)")


@pytest.mark.parametrize("protocol, options", [("allreduce", {}), ("diloco", {"sync_every": 2}), ("gossip", {})])
def test_every_protocol_s_run_carries_a_busy_share_per_peer(protocol, options):
    config = SimConfig(peers=2, protocol=protocol, task="quadratic", task_options={"dim": 16}, steps=3,
                       options={"round_timeout_s": 20.0, **options})
    result = Simulation(config).run()
    shares = result.summary["busy_share"]
    assert set(shares) == {"0", "1"}
    for peer in result.peers:
        assert shares[str(peer.rank)] == busy_share(peer.records) and 0.0 < shares[str(peer.rank)] <= 1.0
