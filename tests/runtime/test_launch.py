"""NodeLaunch: what a starting peer asks of its swarm (what a first node fixes, what a joiner
insists on, what a resumed peer trains), without a node or a socket."""
from __future__ import annotations

import pytest

from starling.protocols import ProtocolError
from starling.runtime import CheckpointError, CheckpointStore, NodeLaunch, TrainSpec
from starling.runtime.replica import REPLICA_RANKS_KEY


def test_a_first_node_fixes_the_whole_spec_with_the_run_length_filled_in():
    launch = NodeLaunch("sketch-dp", options={"lr": "0.1"}, steps=50).resolve()
    config = launch.swarm_config()
    assert config == {"protocol": "sketch-dp", "task": "charlm", "options": {"lr": "0.1", "budget_steps": 50},
                      "task_options": {}, "seed": 0, REPLICA_RANKS_KEY: 1}
    assert TrainSpec.from_swarm_config(config) == launch.spec()


def test_a_joiner_insists_only_on_what_it_was_told_and_learns_the_rest():
    assert NodeLaunch(joining=True).swarm_config() == {REPLICA_RANKS_KEY: 1}
    told = NodeLaunch("sketch-dp", options={"lr": "0.1"}, steps=50, seed=7, joining=True).resolve()
    # its options as given, not the run length it filled in; the seed is the swarm's
    assert told.swarm_config() == {"protocol": "sketch-dp", "options": {"lr": "0.1"}, REPLICA_RANKS_KEY: 1}
    assert not NodeLaunch(joining=True).trains({"task": "charlm"})
    assert NodeLaunch(joining=True).trains({"protocol": "gossip"})


def test_a_node_that_does_not_train_says_nothing():
    launch = NodeLaunch().resolve()
    assert not launch.may_train and launch.swarm_config() is None and not launch.trains(None)


@pytest.mark.parametrize("launch, error, needle", [
    (NodeLaunch(task="quadratic"), ValueError, "--task and protocol options need --protocol"),
    (NodeLaunch(options={"lr": "0.1"}, joining=True), ValueError, "need --protocol"),
    (NodeLaunch("gossip", options={"topology": "moebius"}), ProtocolError, "topology"),
    (NodeLaunch("nosuch"), ProtocolError, "unknown protocol"),
])
def test_a_launch_it_cannot_run_is_refused_naming_what_is_wrong(launch, error, needle):
    with pytest.raises(error, match=needle):
        launch.resolve()


def test_a_replica_of_many_ranks_must_train():
    with pytest.raises(ValueError, match="a replica of many ranks trains"):
        NodeLaunch(replica_ranks=2)
    assert NodeLaunch("diloco", replica_ranks=2).swarm_config()[REPLICA_RANKS_KEY] == 2


def test_a_resumed_peer_trains_what_its_newest_checkpoint_names(tmp_path):
    with pytest.raises(CheckpointError, match="names the swarm"):
        NodeLaunch(resume_from=tmp_path).resolve()
    swarm = {"protocol": "allreduce", "task": "quadratic", "options": {"lr": "0.05", "round_timeout_s": 5.0},
             "task_options": {}, "seed": 3}
    CheckpointStore(tmp_path).write(4, {"x": 1}, meta={"swarm": swarm})
    launch = NodeLaunch(options={"lr": "0.2"}, resume_from=tmp_path).resolve()
    # the checkpoint's swarm, with the options this peer was given on top
    assert launch.spec() == TrainSpec("allreduce", "quadratic", {"lr": "0.2", "round_timeout_s": 5.0}, {}, 3)
    # a peer that names a protocol, or joins, is told what to train elsewhere
    assert NodeLaunch("gossip", resume_from=tmp_path).resolve().protocol == "gossip"
    assert NodeLaunch(resume_from=tmp_path, joining=True).resolve().protocol is None
