"""A trainer that checkpoints, stops and resumes lands where an uninterrupted run lands."""
from __future__ import annotations

import pytest
import torch
from conftest import hold_against

from starling.node.identity import Identity
from starling.runtime import CheckpointConfig, CheckpointError, Trainer, TrainSpec

SPEC = TrainSpec(protocol="diloco", task="quadratic", options={"sync_every": 3, "lr": 0.05}, seed=3)


def _trainer(make_node, spec: TrainSpec, checkpoint: CheckpointConfig | None) -> Trainer:
    trainer = Trainer(make_node("inproc"), spec, rank=0, world=1, serve_state=False, checkpoint=checkpoint)
    trainer.create_protocol()
    return trainer


def _run(trainer: Trainer, steps: int) -> None:
    batches = trainer.batches()
    while trainer.proto.step_count < steps:
        trainer.step(next(batches))


def _params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.proto.eval_model().parameters()]


def test_resume_continues_bit_for_bit_from_the_newest_checkpoint(make_node, tmp_path):
    whole = _trainer(make_node, SPEC, None)
    _run(whole, 14)

    config = CheckpointConfig(str(tmp_path / "ckpt"), every=5, keep=2)
    first = _trainer(make_node, SPEC, config)
    _run(first, 12)  # checkpoints at 5 and 10; steps 11 and 12 are lost with the "crash"
    first.close()

    second = _trainer(make_node, SPEC, config)
    checkpoint = second.resume()
    assert checkpoint is not None and checkpoint.step == 10 and second.proto.step_count == 10
    _run(second, 14)
    assert all(torch.equal(a, b) for a, b in zip(_params(whole), _params(second)))
    second.close()


def test_resume_with_no_checkpoint_starts_fresh(make_node, tmp_path):
    trainer = _trainer(make_node, SPEC, CheckpointConfig(str(tmp_path), every=5))
    assert trainer.resume() is None and trainer.proto.step_count == 0


def test_a_checkpoint_of_another_swarm_is_refused(make_node, tmp_path):
    config = CheckpointConfig(str(tmp_path), every=2)
    first = _trainer(make_node, SPEC, config)
    _run(first, 2)
    first.close()
    other = TrainSpec(protocol="diloco", task="quadratic", options={"sync_every": 4, "lr": 0.05}, seed=3)
    with pytest.raises(CheckpointError, match="written by a swarm"):
        _trainer(make_node, other, config).resume()


def test_checkpoint_config_is_checked():
    with pytest.raises(ValueError, match="every"):
        CheckpointConfig("x", every=0)


def test_a_restarted_peer_still_holds_the_bans_of_its_checkpoint(make_node, tmp_path):
    config = CheckpointConfig(str(tmp_path / "ckpt"), every=5, keep=2)
    first = _trainer(make_node, SPEC, config)
    banned, accused = Identity.generate(), Identity.generate()
    hold_against(first.node, banned, accused)
    assert first.node.trust.is_banned(banned.peer_id)
    _run(first, 5)
    first.close()

    second = _trainer(make_node, SPEC, config)  # a new node: it knows no ban of its own
    assert not second.node.trust.is_banned(banned.peer_id)
    second.resume()
    assert second.node.trust.is_banned(banned.peer_id)  # the verifiable ban, with its round
    assert second.node.trust.banned[banned.peer_id].round == 7
    assert not second.node.trust.is_banned(accused.peer_id)  # an accusation is no ban
    second.close()


def test_malformed_bans_in_a_checkpoint_are_refused_and_change_nothing(make_node):
    node = make_node("inproc")

    async def load(state):
        return node.trust.load_state_dict(state)

    with pytest.raises(ValueError, match="bans are malformed"):
        node.run(load({"bans": [{"peer": "x", "kind": "k"}]}))
    assert node.trust.banned == {}
    assert node.run(load(None)) == 0
