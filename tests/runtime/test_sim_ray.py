"""`ray=ADDRESS`: the sharded simulator's workers as Ray actors, on a cluster of two Ray nodes
started on this machine (`ray.cluster_utils.Cluster`, one CPU and 80 MB of object store each).

Each node runs its own raylet and worker processes, so the actors are separate processes
placed by Ray as on separate machines; only their address is loopback here."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from starling.runtime import SimConfig, SimError, Simulation

NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
RUN = dict(peers=8, protocol="allreduce", task="quadratic", task_options={"dim": 16}, steps=5, transport="tcp",
           ready_timeout_s=120)


def _topics(result: Any) -> set[str]:
    return {topic for peer in result.peers for record in peer.records for topic in record["bytes_by_topic"]}


@pytest.fixture
def two_node_cluster(ray_on_loopback) -> Iterator[Any]:
    import ray  # here, not at the top: the other test workers collect this file without importing Ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=NODE)
    try:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()  # a driver connection a failed run left open
        cluster.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_peers_train_in_ray_actors_on_both_nodes_and_a_lost_node_fails_the_run(two_node_cluster):
    import ray

    cluster = two_node_cluster
    node_ids = {cluster.head_node.node_id, *(node.node_id for node in cluster.worker_nodes)}
    config = SimConfig(**RUN, ray=cluster.address)  # processes 0: one worker per node
    # A gossip run, then its allreduce baseline on the nodes the run formed: one swarm across
    # the cluster for both.
    gossip = replace(config, protocol="gossip")
    run, result = Simulation(gossip).run_compared(gossip.baseline())
    summary = result.summary
    assert not ray.is_initialized()  # the runs connected for themselves and let go after
    assert run.summary["protocol"] == "gossip" and summary["protocol"] == "allreduce"
    for each in (run, result):
        assert each.config.processes == 2 and each.summary["ray"] == cluster.address
        assert each.summary["peer_status"] == {str(rank): "finished" for rank in range(8)}
        assert all(len(peer.records) == 5 for peer in each.peers)
        workers = each.summary["workers"]
        assert [w["ranks"] for w in workers] == [[0, 2, 4, 6], [1, 3, 5, 7]]
        assert {w["node_id"] for w in workers} == node_ids  # SPREAD: one worker on each node
        assert all(w["host"] == "127.0.0.1" for w in workers)  # the node's address, as Ray gave it
    # the run's nodes greeted the swarm; the baseline's were in it already
    assert "$hello" in _topics(run) and "$hello" not in _topics(result)
    # allreduce without churn repeats bit for bit: the actors ran the same swarm as threads do,
    # the baseline on the run's nodes as on nodes of its own
    threads = Simulation(replace(config, ray=None)).run()
    assert summary["eval_loss"] == threads.summary["eval_loss"]

    with pytest.raises(SimError, match=r"no Ray cluster answers at 127\.0\.0\.1:1 \(.*\): start one with `ray start"):
        Simulation(replace(config, ray="127.0.0.1:1")).run()

    # A machine lost mid-run fails the run naming the worker, its node and its ranks, promptly.
    lost = next(iter(cluster.worker_nodes))
    removed_at: list[float] = []

    def lose_a_node(step: int) -> None:
        if step >= 3 and not removed_at:
            removed_at.append(time.monotonic())
            cluster.remove_node(lost, allow_graceful=False)

    long_run = replace(config, steps=100_000)
    with pytest.raises(SimError, match=rf"Ray worker [01] on node {lost.node_id[:12]} \(127\.0\.0\.1\) died \(.*\) "
                                       r"while it held ranks [01], [23], [45], [67]$"):
        Simulation(long_run, progress=lose_a_node).run()
    assert removed_at and time.monotonic() - removed_at[0] < 60
    assert not ray.is_initialized()
