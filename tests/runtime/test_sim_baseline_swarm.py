"""A baseline trains on the swarm its run formed: worker processes take it up on the same
nodes, with fresh models, and it comes out as a baseline on fresh nodes does."""
from __future__ import annotations

from dataclasses import replace

import pytest

from starling.runtime import SimConfig, Simulation
from starling.runtime.churn import parse_churn
from starling.runtime.sim import shares_swarm

RUN = SimConfig(peers=6, processes=2, protocol="gossip", task="quadratic", steps=3)


def _topics(result) -> set[str]:
    return {topic for peer in result.peers for record in peer.records for topic in record["bytes_by_topic"]}


@pytest.mark.slow
def test_a_baseline_on_the_runs_nodes_trains_as_it_does_on_nodes_of_its_own():
    run, on_its_nodes = Simulation(RUN).run_compared(RUN.baseline())
    alone = Simulation(RUN.baseline()).run()
    assert run.summary["protocol"] == "gossip" and on_its_nodes.summary["protocol"] == "allreduce"
    assert all(p.status == "finished" for p in run.peers + on_its_nodes.peers)
    # the same nodes (ids are seeded by rank in both, so this says only that each rank is there)
    assert [p.peer_id for p in on_its_nodes.peers] == [p.peer_id for p in alone.peers]
    for key in ("eval_loss", "train_loss", "bytes_sent_per_peer", "final_peers"):
        assert on_its_nodes.summary[key] == alone.summary[key], key
    # nodes of its own greeted the swarm; the run's nodes had, before the baseline began
    assert "$hello" in _topics(alone) and "$hello" in _topics(run) and "$hello" not in _topics(on_its_nodes)
    # each run's steps count from its own start
    assert [r["step"] for r in on_its_nodes.peers[0].records] == [0, 1, 2]


def test_only_a_baseline_of_the_same_swarm_in_worker_processes_shares_its_nodes():
    base = RUN.baseline()
    assert shares_swarm(RUN, base)
    on_ray = replace(RUN, processes=0, transport="tcp", ray="auto")  # one worker per Ray node
    assert shares_swarm(on_ray, on_ray.baseline())
    assert not shares_swarm(replace(RUN, processes=0, transport="inproc"), replace(base, processes=0,
                                                                                   transport="inproc"))
    churned = replace(RUN, churn=parse_churn("kill:1@2"))
    assert not shares_swarm(churned, churned.baseline())
    timed = replace(RUN, duration_s=5.0)
    assert not shares_swarm(timed, timed.baseline())
    assert not shares_swarm(RUN, replace(base, peers=7))  # another swarm
    assert not shares_swarm(RUN, replace(base, seed=1))
    assert not shares_swarm(RUN, RUN)  # a run that is its own baseline is run once


def test_a_worker_waiting_for_the_next_run_ends_when_the_parent_goes_no_further():
    """After a run's results, a worker waits for `next` (the parent's stop is still set then,
    and says nothing); `end`, which a parent sends as it closes, ends the wait at once."""
    import queue
    import threading
    import time
    import types

    from starling.runtime.sim_processes import WorkerLink, _Worker

    link = WorkerLink(queue.Queue(), threading.Event(), threading.Event(), types.SimpleNamespace(value=0.0))
    link.stop.set()
    inbox: queue.Queue = queue.Queue()
    worker = _Worker(RUN, 0, inbox, link, "", "127.0.0.1", RUN.baseline())
    inbox.put(("records", []))  # a stray introduction is no reason to go on
    inbox.put(("end",))
    began = time.monotonic()
    assert worker._take_up([], RUN.baseline()) is False and time.monotonic() - began < 5
    inbox.put(("next",))
    assert worker._take_up([], RUN.baseline()) is True and worker.config == RUN.baseline()
