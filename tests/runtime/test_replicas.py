"""Replicas of many ranks: torch.distributed (gloo) inside a replica, Starling between.

Each multi-process test runs `Simulation(nproc_per_replica=2)`: every rank a process of its own,
rank 0 of each replica its Starling peer. Every rank reports digests of its model and of the
swarm's model (the outer parameters) as it ends holding them.
"""
from __future__ import annotations

import pytest

from starling.node import JoinError
from starling.runtime import SimConfig, Simulation, Trainer, TrainSpec, parse_churn
from starling.runtime.replica import REPLICA_RANKS_KEY, Replica, ReplicaError, ReplicaGroup, check_replica_ranks

TINY = {"corpus_chars": 60_000, "n_layer": 1, "n_embd": 32, "seq_len": 32, "batch_size": 8, "eval_batches": 1}


def run(steps: int, churn: str = "", peers: int = 2, **options):
    config = SimConfig(peers=peers, protocol="streaming-diloco", steps=steps, nproc_per_replica=2,
                       churn=parse_churn(churn) if churn else (), task_options=TINY,
                       options={"sync_every": 4, "fragments": 2, **options})
    return {p.rank: p for p in Simulation(config).run().peers}


def digests(peer, what: str) -> list[str]:
    return [d[what] for d in peer.protocol_info["replica"]["digests"]]


@pytest.mark.slow
def test_two_replicas_of_two_ranks_end_with_identical_outer_parameters_on_all_four_ranks():
    peers = run(steps=12)
    assert [p.status for p in peers.values()] == ["finished", "finished"]
    swarm = digests(peers[0], "swarm") + digests(peers[1], "swarm")
    assert len(swarm) == 4 and len(set(swarm)) == 1
    for peer in peers.values():  # the ranks of a replica hold the same parameters, not the other replica's
        assert len(set(digests(peer, "model"))) == 1
        assert sum(r["synced"] for r in peer.records) >= 4  # its outer steps went through the swarm
    assert digests(peers[0], "model") != digests(peers[1], "model")


@pytest.mark.slow
def test_sigkill_of_one_rank_takes_its_replica_out_and_the_other_goes_on():
    peers = run(steps=24, churn="kill:1@4")
    killed, survivor = peers[1], peers[0]
    assert killed.status == "killed" and "left the swarm" in (killed.error or "")
    assert len(killed.records) < 24
    assert survivor.status == "finished" and len(survivor.records) == 24
    assert survivor.records[-1]["peers"] == 1  # its last rounds without the replica that left
    assert len(set(digests(survivor, "model"))) == 1 and len(set(digests(survivor, "swarm"))) == 1


@pytest.mark.slow
def test_a_replica_joins_mid_run_fetches_the_state_and_ends_with_the_same_outer_parameters():
    # A fragment's round in flight when the joiner arrives can close without a replica on some
    # members and not on others (seen on a loaded box: "round 1 went on without ..."), which
    # the protocol's drift guard repairs at its next check; here it checks at every sync.
    peers = run(steps=30, churn="join@4", check_every=1)
    joiner = peers[2]
    assert [p.status for p in peers.values()] == ["finished"] * 3
    assert joiner.joined_at_step > 0 and len(joiner.records) == 30 - joiner.joined_at_step
    assert len(set(digests(joiner, "model"))) == 1
    swarm = [d for p in peers.values() for d in digests(p, "swarm")]
    assert len(swarm) == 6 and len(set(swarm)) == 1


def test_a_replica_of_another_rank_count_is_refused_with_a_clear_error(make_node):
    first = make_node(swarm_config={"protocol": "streaming-diloco", REPLICA_RANKS_KEY: 2})
    with pytest.raises(JoinError, match="replica_ranks: swarm has 2, this node has 3"):
        make_node(join=[first.address], swarm_config={REPLICA_RANKS_KEY: 3})
    # a joiner that said nothing at its hello is refused before it builds its model
    joiner = make_node(join=[first.address])
    trainer = Trainer(joiner, TrainSpec("streaming-diloco", task_options=TINY), 0, 1)
    with pytest.raises(ReplicaError, match="replicas have 2 ranks each and this one has 1: start it with "
                                           "--nproc-per-replica 2"):
        trainer.create_protocol()
    assert trainer.proto is None


def test_the_first_peer_of_a_swarm_fixes_its_replicas_rank_count(make_node):
    node = make_node(swarm_config={"protocol": "streaming-diloco"})
    trainer = Trainer(node, TrainSpec("streaming-diloco", task_options=TINY), 0, 1,
                      replication=Replica(ReplicaGroup(0, 2, "env://")))
    trainer.create_protocol()
    assert node.swarm_config[REPLICA_RANKS_KEY] == 2
    check_replica_ranks({}, 1)  # a swarm that never said: replicas of one rank
    with pytest.raises(ReplicaError):
        check_replica_ranks({}, 2)


def test_torchrun_environment_names_the_group_and_each_rank_its_shard():
    assert ReplicaGroup.from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    group = ReplicaGroup.from_env({"WORLD_SIZE": "4", "RANK": "3"}, timeout_s=5.0)
    assert group is not None and (group.rank, group.size, group.init_method) == (3, 4, "env://")
    assert group.shard(1, 2) == (7, 8)  # replica 1 of 2: ranks 4..7 of 8 shards
    with pytest.raises(ValueError, match="replica rank 2 of 2"):
        ReplicaGroup(2, 2, "env://")


def test_a_protocol_whose_steps_need_other_peers_cannot_run_in_replicas():
    with pytest.raises(Exception, match="does not take its inner steps alone"):
        Simulation(SimConfig(peers=2, protocol="allreduce", steps=2, nproc_per_replica=2, task_options=TINY)).run()


def test_a_loss_that_does_not_call_the_model_is_refused_and_the_replica_leaves(make_node, tmp_path):
    node = make_node(swarm_config={"protocol": "diloco"})
    group = ReplicaGroup(0, 1, f"file://{tmp_path}/rendezvous", timeout_s=10.0)
    trainer = Trainer(node, TrainSpec("diloco", task="quadratic", task_options={"dim": 8}), 0, 1,
                      replication=Replica(group))
    trainer.create_protocol()
    group.init()
    try:
        trainer.lead_replica()
        with pytest.raises(ReplicaError, match="'quadratic'.s loss does not call the model.*left the swarm"):
            trainer.step(next(trainer.batches()))
    finally:
        group.close()
    assert node.closed  # it left the swarm


def test_launch_replica_gives_each_process_its_replication(monkeypatch):
    """The one path `node start` and a Python caller take: torchrun's environment names the
    rank, and the replication follows from it and --shard-sync."""
    from starling.runtime import Single, launch_replica
    from starling.runtime.replica_launch import rank_endpoint
    from starling.runtime.shard_sync import ShardSync

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "STARLING_SPAWNED_RANK"):
        monkeypatch.delenv(name, raising=False)
    alone = launch_replica(1)
    assert isinstance(alone.replication, Single) and not alone.follows and alone.replication.speaks
    assert alone.listen(["tcp://127.0.0.1:7000"]) == ["tcp://127.0.0.1:7000"] and alone.seeds(["x"]) == ["x"]
    with pytest.raises(ValueError, match="--nproc-per-replica 2 or more"):
        launch_replica(1, shard_sync=True)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    follower = launch_replica(1)
    assert isinstance(follower.replication, Replica) and follower.follows
    assert follower.replication.shard(1, 4) == (5, 12)
    rank = launch_replica(1, shard_sync=True)
    assert isinstance(rank.replication, ShardSync) and not rank.follows and not rank.replication.speaks
    assert rank.replication.swarm_config() == {REPLICA_RANKS_KEY: 3, "shard_rank": 2}
    assert rank.listen(["tcp://127.0.0.1:7000", "tcp://127.0.0.1:0"]) == ["tcp://127.0.0.1:7002", "tcp://127.0.0.1:0"]
    assert rank_endpoint("ipc:///tmp/x", 2) == "ipc:///tmp/x"
    with pytest.raises(ValueError, match="under torchrun the replica's ranks are torchrun's"):
        launch_replica(2)
