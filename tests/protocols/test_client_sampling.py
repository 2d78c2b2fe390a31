"""Client sampling in DiLoCo's rounds: each round a subset drawn from a shared seed trains and
contributes, the others wait and take the merged model; every peer ends with the same model."""
from __future__ import annotations

import pytest

from starling.protocols.diloco_config import DiLoCoConfig
from starling.protocols.sampling import draw_clients
from starling.runtime import SimConfig, Simulation

MEMBERS = tuple(f"peer{i:03d}" for i in range(100))


def test_every_member_draws_the_same_clients_for_a_round_and_other_rounds_draw_others():
    config = DiLoCoConfig(sample_fraction=0.1)
    first = draw_clients(MEMBERS, 7, config)
    assert len(first) == 10 and first == draw_clients(tuple(reversed(MEMBERS)), 7, config)
    assert first != draw_clients(MEMBERS, 8, config)
    assert len(draw_clients(MEMBERS, 7, DiLoCoConfig(clients_per_round=25))) == 25
    assert len(draw_clients(MEMBERS[:3], 0, DiLoCoConfig(sample_fraction=0.01))) == 1  # at least one
    assert draw_clients(MEMBERS, 7, DiLoCoConfig(sample_fraction=0.1, sample_seed=1)) != first
    counts = {m: 0 for m in MEMBERS}  # over many rounds each member is drawn about F of the time
    for k in range(500):
        for m in draw_clients(MEMBERS, k, config):
            counts[m] += 1
    assert 20 <= min(counts.values()) and max(counts.values()) <= 85


@pytest.mark.parametrize("options, why", [
    ({"sample_fraction": 0.0}, "sample_fraction must be in"),
    ({"clients_per_round": -1}, "clients_per_round must be >= 0"),
    ({"sample_fraction": 0.5, "fragments": 2, "sync_every": 4}, "whole rounds"),
    ({"clients_per_round": 2, "quorum": 2}, "whole rounds"),
])
def test_sampling_that_cannot_work_is_refused(options, why):
    with pytest.raises(ValueError, match=why):
        DiLoCoConfig(**options)


def run(**options):
    config = SimConfig(peers=8, protocol="diloco", steps=16, task="teacher",
                       task_options={"partition": "dirichlet:0.5", "batch_size": 16},
                       options={"sync_every": 4, "check_every": 1, **options})
    return Simulation(config).run()


@pytest.mark.slow
def test_sampled_rounds_train_half_the_swarm_and_every_peer_ends_with_the_merged_model():
    sampled, full = run(sample_fraction=0.5), run()
    summary = sampled.summary
    assert summary["final_peers"] == 8 and summary["participation"]["mean"] == 0.5
    assert summary["participation"]["clients_per_step"] == [4] * 16
    assert "participation" not in full.summary
    assert len({p.eval_loss for p in sampled.peers}) == 1  # the same outer parameters on every peer
    waited = [sum(not r.get("sampled", True) for r in p.records) for p in sampled.peers]
    assert sum(waited) == 8 * 16 // 2 and all(w % 4 == 0 for w in waited)  # whole rounds, half of them
    # a peer drawn after rounds without it first takes their model (outer state and momentum)
    assert max(p.protocol_info.get("rounds_waited", 0) for p in sampled.peers) >= 1
