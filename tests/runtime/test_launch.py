"""NodeLaunch: what a starting peer asks of its swarm (what a first node fixes, what a joiner
insists on, what a resumed peer trains), without a node or a socket; and PeerRun: how the peer
runs once its node is up (where it starts from, its records, checkpoints), on inproc nodes."""
from __future__ import annotations

import logging
import threading

import pytest

from starling.protocols import ProtocolError
from starling.runtime import CheckpointConfig, CheckpointError, CheckpointStore, NodeLaunch, PeerRun, TrainSpec
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


# PeerRun: how a peer runs once its node is up, as `node start` runs it.

QUADRATIC = NodeLaunch("allreduce", "quadratic", {"lr": "0.1"}, steps=6)


def test_a_first_node_trains_and_says_its_progress(make_node):
    launch = QUADRATIC.resolve()
    node = make_node("inproc", swarm_config=launch.swarm_config())
    records = []
    stopped = PeerRun(launch, shard=(0, 1), log_every=3).run(node, threading.Event(), records.append)
    assert [r.get("event") for r in records] == ["training", None, None, "stopped"]
    assert records[0]["protocol"] == "allreduce" and records[0]["shard"] == "0/1" and records[0]["step"] == 0
    assert [r["step"] for r in records[1:3]] == [3, 6]
    assert stopped is records[-1] and stopped["step"] == 6 and "eval_loss" in stopped
    assert node.status()["meta"]["step"] == 6  # what `node watch` on any peer shows of it


def test_a_joiner_takes_the_swarm_state_and_they_train_together(make_node, caplog):
    launch = QUADRATIC.resolve()
    first = make_node("inproc", swarm_config=launch.swarm_config())
    ran: dict[str, dict] = {}
    thread = threading.Thread(target=lambda: ran.setdefault("first", PeerRun(launch, (0, 2), min_peers=2).run(
        first, threading.Event())))
    thread.start()  # it waits for the joiner
    joiner_launch = NodeLaunch(joining=True, steps=6).resolve()
    joiner = make_node("inproc", join=[first.address], swarm_config=joiner_launch.swarm_config())
    caplog.set_level(logging.INFO, logger="starling.runtime.trainer")
    stopped = PeerRun(joiner_launch, (1, 2), min_peers=2).run(joiner, threading.Event())
    thread.join(60)
    assert "joined from" in caplog.text  # the swarm's state, not its own start
    assert stopped["step"] == ran["first"]["step"] == 6


def test_a_peer_that_does_not_train_stays_until_stopped(make_node):
    node = make_node("inproc")
    stop = threading.Event()
    stop.set()
    assert PeerRun(NodeLaunch().resolve()).run(node, stop) is None


def test_a_swarm_too_small_in_time_is_a_timeout(make_node):
    launch = QUADRATIC.resolve()
    node = make_node("inproc", swarm_config=launch.swarm_config())
    with pytest.raises(TimeoutError, match="only 1 peers were up"):
        PeerRun(launch, min_peers=2, min_peers_timeout_s=0.1).run(node, threading.Event())


def test_a_resumed_peer_checkpoints_where_it_resumed_from(make_node, tmp_path):
    launch = NodeLaunch("allreduce", "quadratic", steps=4, resume_from=tmp_path).resolve()
    assert PeerRun(launch).checkpoints.directory == str(tmp_path)
    assert PeerRun(launch, checkpoint=CheckpointConfig(str(tmp_path / "b"), 5)).checkpoints.every == 5
    node = make_node("inproc", swarm_config=launch.swarm_config())
    assert PeerRun(launch, checkpoint=CheckpointConfig(str(tmp_path), 2)).run(node, threading.Event())["step"] == 4
    steps = [c.step for c in CheckpointStore(tmp_path).list()]
    # the newest is the last step's; step 2's is skipped when the writer is still behind (a loaded box)
    assert steps[0] == 4 and set(steps) <= {2, 4}, steps


@pytest.mark.parametrize("options, needle", [
    ({"shard": (2, 2)}, "shard"), ({"min_peers": 0}, "min_peers"), ({"resume_quorum": 0}, "resume_quorum"),
])
def test_run_options_it_cannot_use_are_refused(options, needle):
    with pytest.raises(ValueError, match=needle):
        PeerRun(QUADRATIC, **options)
