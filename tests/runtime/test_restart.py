"""Peers restarting from checkpoints agree on a step through their heartbeat metadata."""
from __future__ import annotations

import pytest
from conftest import in_parallel, swarm, wait_until

from starling.runtime import CheckpointStore
from starling.runtime.restart import CHECKPOINTS_META, RestartError, agree_on_step, held_steps, holders_of


def _store(tmp_path, name: str, steps: list[int]) -> CheckpointStore:
    store = CheckpointStore(tmp_path / name, keep=5)
    for step in steps:
        store.write(step, {"step": step})
    return store


def test_every_peer_picks_the_newest_step_the_quorum_holds(make_node, tmp_path):
    nodes = swarm(make_node, 3)
    stores = [_store(tmp_path, "a", [20, 30, 40]), _store(tmp_path, "b", [20, 30, 40]),
              _store(tmp_path, "c", [10, 20, 30])]  # c's write of 40 was cut short
    everyone = in_parallel([lambda n=n, s=s: agree_on_step(n, s, 3, timeout_s=30) for n, s in zip(nodes, stores)])
    assert everyone == [30, 30, 30]
    two = in_parallel([lambda n=n, s=s: agree_on_step(n, s, 2, timeout_s=30) for n, s in zip(nodes, stores)])
    assert two == [40, 40, 40]
    assert holders_of(nodes[2], 40) == sorted(n.peer_id for n in nodes[:2])


def test_no_step_held_by_a_quorum_means_a_fresh_start(make_node, tmp_path):
    nodes = swarm(make_node, 2)
    stores = [_store(tmp_path, "a", [10]), _store(tmp_path, "b", [])]
    assert in_parallel([lambda n=n, s=s: agree_on_step(n, s, 2, timeout_s=30)
                        for n, s in zip(nodes, stores)]) == [None, None]


def test_too_few_peers_within_the_timeout_is_an_error(make_node, tmp_path):
    node = make_node("inproc")
    with pytest.raises(RestartError, match="only 1 of the 2 peers"):
        agree_on_step(node, _store(tmp_path, "a", [10]), 2, timeout_s=0.3)
    with pytest.raises(ValueError, match="quorum"):
        agree_on_step(node, _store(tmp_path, "b", [10]), 0, timeout_s=0.3)


def test_malformed_advertisements_count_as_holding_nothing(make_node):
    a, b = swarm(make_node, 2)
    b.set_meta(**{CHECKPOINTS_META: "12,x,-3,99999999999999999,7"})
    assert wait_until(lambda: b.peer_id in held_steps(a))
    assert held_steps(a)[b.peer_id] == {12, 7}
