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
    result = Simulation(config).run()
    summary = result.summary
    assert not ray.is_initialized()  # the run connected for itself and let go after
    assert result.config.processes == 2 and summary["ray"] == cluster.address
    assert summary["peer_status"] == {str(rank): "finished" for rank in range(8)}
    assert all(len(peer.records) == 5 for peer in result.peers)
    workers = summary["workers"]
    assert [w["ranks"] for w in workers] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert {w["node_id"] for w in workers} == node_ids  # SPREAD: one worker on each node
    assert all(w["host"] == "127.0.0.1" for w in workers)  # the node's address, as Ray gave it
    # allreduce without churn repeats bit for bit: the actors ran the same swarm as threads do
    threads = Simulation(replace(config, ray=None)).run()
    assert summary["eval_loss"] == threads.summary["eval_loss"]

    # A baseline trains on the nodes its run formed there: no second swarm across the cluster,
    # and it comes out as the allreduce run above did.
    gossip = replace(config, protocol="gossip")
    run, baseline = Simulation(gossip).run_compared(gossip.baseline())
    assert not ray.is_initialized()
    assert run.summary["protocol"] == "gossip" and baseline.summary["protocol"] == "allreduce"
    assert all(p.status == "finished" for p in run.peers + baseline.peers)
    assert baseline.summary["eval_loss"] == summary["eval_loss"]
    assert {w["node_id"] for w in baseline.summary["workers"]} == node_ids
    topics = {t for peer in baseline.peers for record in peer.records for t in record["bytes_by_topic"]}
    assert "$hello" not in topics and "$hello" in {t for peer in result.peers for record in peer.records
                                                   for t in record["bytes_by_topic"]}

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
