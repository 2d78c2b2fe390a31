"""`processes=P`: the swarm's peers spread over P worker processes, over tcp on loopback.

The multi-process tests spawn real workers; each imports this module by name to find the test
protocol, and each imports torch, which is slow on a loaded machine (hence ready_timeout_s)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import dataclass

import pytest
import torch

from starling.protocols.base import Protocol, ProtocolConfig, StepReport, register, registered_protocols
from starling.runtime import SimConfig, SimError, Simulation, parse_churn, seeded_identity
from starling.runtime.sim_processes import placement


@dataclass(frozen=True)
class PacedConfig(ProtocolConfig):
    lr: float = 0.1
    step_sleep_s: float = 0.05  # pace the steps, so that churn and a killed worker land mid-run


class PacedSGD(Protocol):
    """Test-only local SGD that greets every live peer each step and waits on nobody."""

    name = "test-paced"
    config_class = PacedConfig

    def __init__(self, node, model, config) -> None:
        super().__init__(node, model, config)
        node.on("test-paced.hi", lambda msg: None)

    def step(self, loss_fn) -> StepReport:
        time.sleep(self.config.step_sleep_s)
        loss = loss_fn()
        self.model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in self.model.parameters():
                p -= self.config.lr * p.grad
        self.step_count += 1
        for peer in self.node.live_peers():
            self.node.send(peer, "test-paced.hi", {"step": self.step_count})
        return StepReport(step=self.step_count, loss=loss.item())


class FailingSGD(PacedSGD):
    """Rank 1's peer raises at its third step (peer ids are seeded, so rank 1 is known here)."""

    name = "test-paced-failing"

    def step(self, loss_fn) -> StepReport:
        if self.step_count == 2 and self.node.peer_id == seeded_identity(0, 1).peer_id:
            raise RuntimeError("boom in a worker")
        return super().step(loss_fn)


if "test-paced" not in registered_protocols():
    register(PacedSGD)
    register(FailingSGD)

PACED = dict(protocol=f"{__name__}:test-paced", task="quadratic", task_options={"dim": 16}, transport="tcp",
             ready_timeout_s=180)


def test_processes_is_a_count_and_true_still_means_one_per_peer():
    assert SimConfig(peers=3, transport="tcp", processes=True).processes == 3
    assert SimConfig(peers=3, transport="tcp", processes=False).processes == 0
    assert SimConfig(peers=3, transport="tcp", processes=2).describe()["processes"] == 2
    assert SimConfig(peers=3).processes == 0
    for bad in (-1, 4, 1.5, "2"):
        with pytest.raises(ValueError, match=r"processes must be a whole number from 0 .* to peers \(3\)"):
            SimConfig(peers=3, transport="tcp", processes=bad)
    with pytest.raises(ValueError, match="processes need the tcp or ipc transport"):
        SimConfig(peers=3, processes=2, transport="inproc")


def test_ranks_are_dealt_round_robin():
    assert placement(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert placement(2, 2) == [[0], [1]]
    assert placement(3, 1) == [[0, 1, 2]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_churn_with_processes_kills_leaves_and_joins():
    config = SimConfig(peers=4, processes=2, steps=30, churn=parse_churn("join@3,kill:1@5,leave:2@7"),
                       options={"step_sleep_s": "0.1"}, **PACED)
    steps: list[int] = []
    result = Simulation(config, progress=steps.append).run()
    by_rank = {p.rank: p for p in result.peers}
    assert result.summary["peer_status"] == {"0": "finished", "1": "killed", "2": "left", "3": "finished",
                                             "4": "finished"}
    assert len(by_rank[1].records) == 5 and len(by_rank[2].records) == 7
    joiner = by_rank[4]
    assert joiner.joined_at_step >= 1  # it took a trained state
    assert [r["step"] for r in joiner.records] == list(range(joiner.joined_at_step + 1, 31))
    assert joiner.eval_loss is not None and result.summary["final_peers"] == 3
    assert steps and steps[-1] == 30 and steps == sorted(steps)
    assert not multiprocessing.active_children()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_killed_mid_run_fails_the_run_naming_its_ranks():
    killed: list[int] = []

    def kill_worker_1(step: int) -> None:
        if step >= 3 and not killed:
            for child in multiprocessing.active_children():
                if child.name == "sim-worker-1":
                    os.kill(child.pid, signal.SIGKILL)
                    killed.append(child.pid)

    config = SimConfig(peers=4, processes=2, steps=400, **PACED)  # 20 s of steps: it dies long before
    with pytest.raises(SimError, match=r"worker process 1 exited with code -9 while it held ranks 1, 3"):
        Simulation(config, progress=kill_worker_1).run()
    assert killed
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_peer_failing_in_a_worker_fails_the_run_with_its_error():
    config = SimConfig(peers=3, processes=2, steps=6, **{**PACED, "protocol": f"{__name__}:test-paced-failing"})
    with pytest.raises(SimError, match="peer 1 failed: RuntimeError: boom in a worker"):
        Simulation(config).run()


def test_introductions_that_overtake_rank_0s_address_are_taken_once_the_peers_start():
    """A Ray actor runs the parent's deliveries on threads of its own, in no order: the first
    introductions can reach a worker before rank 0's address. The worker keeps them, forms
    its swarm, and passes them on once its peers are up."""
    import queue
    import threading
    from types import SimpleNamespace

    from starling.runtime.sim_processes import WorkerLink, _Worker

    config = SimConfig(peers=2, processes=1, protocol="gossip", task="quadratic", task_options={"dim": 4},
                       steps=1, transport="tcp", ready_timeout_s=60)
    inbox: queue.Queue = queue.Queue()
    link = WorkerLink(queue.Queue(), threading.Event(), threading.Event(), SimpleNamespace(value=0.0))
    worker = _Worker(config, 0, inbox, link, "", "127.0.0.1")
    formed: list[bool] = []
    thread = threading.Thread(target=lambda: formed.append(worker._form_swarm([0, 1]) and worker._wait_for_start([0, 1])),
                              daemon=True)
    thread.start()
    try:
        kind, rank, address, peer_id, record = link.queue.get(timeout=60)
        assert (kind, rank) == ("address", 0)
        inbox.put(("records", [record]))  # overtakes the address below
        inbox.put(("swarm", address, peer_id))
        while True:
            message = link.queue.get(timeout=60)
            if message[0] == "ready":
                break
        assert message == ("ready", 0, [0, 1])
        link.start.set()
        thread.join(30)
        assert formed == [True]
    finally:
        link.stop.set()
        thread.join(30)
        worker.close()
