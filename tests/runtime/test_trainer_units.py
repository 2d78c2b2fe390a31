"""Trainers of a task with units: the swarm's ledger says what each peer trains, a joiner takes
the swarm's data position with its state, and a restart from checkpoints goes on at the same unit."""
from __future__ import annotations

import pytest
import torch
from conftest import wait_until

from starling.node.identity import Identity
from starling.runtime import CheckpointConfig, Trainer, TrainSpec
from starling.runtime.trainer import TrainSpecError


def _spec(text_corpus, tmp_path, protocol: str = "diloco") -> TrainSpec:
    return TrainSpec(protocol=protocol, task="gpt", options={"sync_every": 1000, "lr": 0.01},
                     task_options={"data": str(text_corpus), "seq_len": "16", "batch_size": "2", "n_embd": "16",
                                   "n_layer": "1", "cache_dir": str(tmp_path / "tokens")}, seed=5)


def _trainer(node, spec, **kwargs) -> Trainer:
    trainer = Trainer(node, spec, rank=0, world=1, **kwargs)
    trainer.create_protocol()
    return trainer


def _train(trainer: Trainer, steps: int) -> list[int]:
    """The units `trainer` trains in its next `steps` steps."""
    batches, units = trainer.batches(), []
    for _ in range(steps):
        batch = next(batches)
        units.append(trainer._batch_index)
        assert all(torch.equal(a, b) for a, b in zip(batch, trainer.task.unit_batch(units[-1])))
        trainer.step(batch)
    return units


def test_a_lone_peer_trains_the_epoch_in_its_order_and_a_restart_goes_on_at_the_same_unit(make_node, text_corpus,
                                                                                            tmp_path):
    spec = _spec(text_corpus, tmp_path)
    whole = _trainer(make_node("inproc"), spec, serve_state=False)
    units = whole.ledger.units
    expected = _train(whole, units + 2)
    assert sorted(expected[:units]) == list(range(units))  # an epoch: every unit once
    assert whole.ledger.epoch == 1
    whole.close()

    config = CheckpointConfig(str(tmp_path / "ckpt"), every=3, keep=2)
    key = Identity.generate()  # a restarted peer is the same peer: its key is on its disk
    first = _trainer(make_node("inproc", key=key), spec, serve_state=False, checkpoint=config)
    trained = _train(first, 7)  # checkpoints at 3 and 6; step 7 is lost with the "crash"
    first.close()
    second = _trainer(make_node("inproc", key=key), spec, serve_state=False, checkpoint=config)
    assert second.resume().step == 6
    trained = trained[:6] + _train(second, units + 2 - 6)
    assert trained == expected  # neither repeated nor skipped
    assert second.node.status()["info"]["data"]["epoch"] == 1
    second.close()


def test_members_train_disjoint_units_and_a_joiner_takes_fresh_ones_from_the_swarms_position(make_node, text_corpus,
                                                                                              tmp_path):
    spec = _spec(text_corpus, tmp_path)
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    assert wait_until(lambda: a.live_peers() == [b.peer_id] and b.live_peers() == [a.peer_id])
    ta, tb = _trainer(a, spec, snapshot_every_s=0), _trainer(b, spec, snapshot_every_s=0)
    done = _train(ta, 2) + _train(tb, 2)
    assert len(set(done)) == 4  # the two ledgers agree: each unit to one member
    c = make_node("inproc", join=[a.address])
    assert wait_until(lambda: len(c.live_peers()) == 2 and len(a.live_peers()) == 2)
    tc = _trainer(c, spec, serve_state=False)
    tc.fetch_state([a.peer_id])
    assert tc.ledger.digest() == ta.ledger.digest() and tc.proto.step_count == 2
    fresh = _train(tc, 1)
    assert not set(fresh) & set(done)
    for t in (ta, tb, tc):
        t.close()


def test_a_peer_that_skipped_rounds_takes_the_ledger_of_the_rounds_lowest_id_member(make_node, text_corpus, tmp_path):
    spec = _spec(text_corpus, tmp_path)
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    assert wait_until(lambda: a.live_peers() == [b.peer_id] and b.live_peers() == [a.peer_id])
    low, high = sorted((_trainer(a, spec), _trainer(b, spec)), key=lambda t: t.node.peer_id)
    _train(low, 2), _train(high, 2)
    _train(low, 2)  # the swarm goes on to round 4 while `high` is away
    next(low.batches())  # `low` hands out round 4's units (and would train its own)
    high.proto.step_count = 4  # it caught up (as a late peer learns the swarm's round from the owners)
    trained = _train(high, 1)
    assert high.ledger_adopted == 1 and high.ledger.digest() == low.ledger.digest()
    assert trained == [u.index for u in low.ledger.units_of(high.node.peer_id)]  # its own unit of round 4
    for t in (low, high):
        t.close()


def test_a_task_with_units_refuses_audits_it_cannot_recompute(make_node, text_corpus, tmp_path):
    spec = _spec(text_corpus, tmp_path, protocol="allreduce")
    spec = TrainSpec(protocol="allreduce", task="gpt", options={"audit_rate": 0.5}, task_options=spec.task_options,
                     seed=5)
    with pytest.raises(TrainSpecError, match="hands out units"):
        _trainer(make_node("inproc"), spec, serve_state=False)
