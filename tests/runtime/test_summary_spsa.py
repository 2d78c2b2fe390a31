"""The simulate summary's bytes per projected gradient for `spsa`: counted by the nodes, per code
delivered to one peer, with the `samples` that brings it near one byte when the headers dominate."""
from __future__ import annotations

from starling.runtime import SimConfig, Simulation, spsa_bytes_note

QUADRATIC = {"dim": 32}


def run(peers: int, steps: int, **options):
    config = SimConfig(peers=peers, protocol="spsa", task="quadratic", task_options=QUADRATIC, steps=steps,
                       options={"round_timeout_s": 30.0, **options})
    return Simulation(config).run().summary


def test_the_default_reports_its_bytes_per_projected_gradient_and_how_to_bring_them_near_one():
    summary = run(8, 3)
    assert summary["projected_gradients_delivered"] == 3 * 8 * 7  # steps x peers x others, samples=1
    per_gradient = summary["bytes_per_projected_gradient"]
    assert per_gradient == summary["bytes_sent_per_peer"] * 8 / summary["projected_gradients_delivered"]
    # one message per peer per step: its headers (~34 B per code with 8 peers) dominate the one byte
    assert 20 < per_gradient < 60
    assert summary["suggested_samples"] in (32, 64, 128)
    note = spsa_bytes_note(summary)
    assert f"{per_gradient:.2f} B per projected gradient (samples=1)" in note
    assert f"--samples {summary['suggested_samples']} sends about 1." in note


def test_the_suggested_samples_send_between_one_and_two_bytes_per_projected_gradient():
    summary = run(8, 2, samples=64)
    assert summary["projected_gradients_delivered"] == 2 * 8 * 7 * 64
    assert 1.0 < summary["bytes_per_projected_gradient"] <= 2.0
    assert summary["suggested_samples"] is None
    assert "--samples" not in spsa_bytes_note(summary)


def test_other_protocols_have_no_such_row():
    config = SimConfig(peers=2, protocol="allreduce", task="quadratic", task_options=QUADRATIC, steps=2)
    summary = Simulation(config).run().summary
    assert "bytes_per_projected_gradient" not in summary and spsa_bytes_note(summary) is None
