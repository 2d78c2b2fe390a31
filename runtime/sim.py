"""The many-peers-on-one-box simulator.

Every simulated peer is a real `Node` with real sockets and a real protocol. By default all
peers share one process (the process's one network thread, one training thread per peer);
with `processes=P` they are spread over P worker processes that each run their peers the same
way, over tcp (or ipc) on loopback (see `sim_processes.py`), or, with `ray=ADDRESS`, over
P Ray actors spread across a Ray cluster's machines, over tcp (see `sim_ray.py`). Every node's
outgoing links go through a `LinkEmulator` (bandwidth, latency, loss); churn (see
`runtime.churn`) crashes, stops and adds peers at given steps.

    result = Simulation(SimConfig(peers=4, protocol="gossip", steps=100)).run()
    result.summary["eval_loss"], result.summary["bytes_sent_per_peer"]

Initial peers have ranks 0..peers-1; joiners get the next ranks in the order they join, and
every peer's data shard is cut for a world of all the peers that will ever run.
"""
from __future__ import annotations

import logging
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from typing import Any

import torch

from starling.common.heap import building_heap
from starling.node import JoinError
from starling.runtime.capacity import CapacityError, plan_capacity
from starling.runtime.peer import (
    SimPeer,
    close_together,
    on_network_thread,
    raise_if_faulted,
    start_together,
    sync_with_seed,
)
from starling.runtime.replica_sim import run_replicas
from starling.runtime.sim_processes import ProgressFn, run_processes
from starling.runtime.simconfig import SimConfig, SimError, check_config, endpoint_for, wait_for
from starling.runtime.summary import PeerResult, SimResult, summarize
from starling.runtime.trainer import prepare_to_train
from starling.tasks import get_task

log = logging.getLogger(__name__)


class Simulation:
    """Runs one simulated swarm to the end. `progress(step)` gets the swarm's furthest step."""

    def __init__(self, config: SimConfig, progress: ProgressFn | None = None) -> None:
        self.config = config
        self.progress = progress

    def run(self) -> SimResult:
        check_config(self.config)
        prepare_to_train()  # torch's one-time lazy imports, once, not inside the first peer's start
        if self.config.ray is None:
            return self._run()
        from starling.runtime import sim_ray  # Ray is an optional extra: imported for a Ray run only

        with sim_ray.connected(self.config.ray):
            self.config = sim_ray.with_workers(self.config)
            return self._run()

    def run_compared(self, baseline: SimConfig, baseline_progress: ProgressFn | None = None
                     ) -> tuple[SimResult, SimResult]:
        """This run, then `baseline` (this run's `SimConfig.baseline`): results of both. Where
        the baseline's swarm is this run's (`shares_swarm`: worker processes on this machine
        or Ray actors, no churn, no time limit), the baseline trains on the nodes this run
        formed, each with a fresh model, links and counters, so the swarm starts and forms
        once, not twice. Else the baseline is a simulation of its own, after this one."""
        if not shares_swarm(self.config, baseline):
            return self.run(), Simulation(baseline, baseline_progress).run()
        check_config(self.config)
        check_config(baseline)
        prepare_to_train()
        if self.config.ray is None:
            return self._run_compared(baseline, baseline_progress)
        from starling.runtime import sim_ray  # Ray is an optional extra: imported for a Ray run only

        with sim_ray.connected(self.config.ray):
            self.config = sim_ray.with_workers(self.config)
            return self._run_compared(replace(baseline, processes=self.config.processes), baseline_progress)

    def _run_compared(self, baseline: SimConfig, baseline_progress: ProgressFn | None
                      ) -> tuple[SimResult, SimResult]:
        self.config = self.config.sized_for_swarm()
        self._fit()
        # the nodes are this run's: their liveness and socket cap, which the baseline's own
        # plan would have given them too (it has the same swarm)
        base = replace(baseline, liveness=self.config.liveness, ready_timeout_s=self.config.ready_timeout_s,
                       max_dealers=self.config.max_dealers)
        workers: dict[str, list[dict[str, Any]]] = {}
        if self.config.ray is not None:
            from starling.runtime.sim_ray import run_ray

            runs, placed = run_ray(self.config, self.progress, base, baseline_progress)
            workers = {"workers": placed}
        else:
            runs = run_processes(self.config, self.progress, base, baseline_progress)
        # SimError if a peer failed
        run = SimResult(self.config, runs[0][0], {**summarize(self.config, *runs[0]), **workers})
        base_peers, base_t0 = runs[1]
        return run, SimResult(base, base_peers, {**summarize(base, base_peers, base_t0), **workers})

    def _fit(self) -> None:
        """Fit the run's peers in their processes: the socket cap they run with (SimError if
        they cannot fit)."""
        # Every process holds its share of the peers that will ever run (all of them, without
        # workers): fit them, or refuse before any node starts. A worker's descriptor limit
        # is this process's (it inherits the raised soft limit; a Ray actor raises its own
        # machine's, planned here as if it were this one).
        try:
            capacity = plan_capacity(self.config.peers_per_process(), self.config.world, self.config.transport,
                                     monitors=self.config.transport != "inproc",
                                     max_dealers=self.config.max_dealers, processes_hint=self.config.processes)
        except CapacityError as exc:
            raise SimError(str(exc)) from None
        self.config = replace(self.config, max_dealers=capacity.max_dealers)

    def _run(self) -> SimResult:
        self.config = self.config.sized_for_swarm()
        if self.config.nproc_per_replica > 1:  # a process per rank, one peer per replica: nothing to plan
            peers, t0 = run_replicas(self.config, self.progress)
            return SimResult(self.config, peers, summarize(self.config, peers, t0))
        self._fit()
        if self.config.ray is not None:
            from starling.runtime.sim_ray import run_ray

            [(peers, t0)], workers = run_ray(self.config, self.progress)
            return SimResult(self.config, peers, {**summarize(self.config, peers, t0), "workers": workers})
        if self.config.processes:
            [(peers, t0)] = run_processes(self.config, self.progress)
        else:
            peers, t0 = self._run_threads()
        return SimResult(self.config, peers, summarize(self.config, peers, t0))

    def _run_threads(self) -> tuple[list[PeerResult], float]:
        config = self.config
        task = get_task(config.task, **config.task_options)
        threads_before = torch.get_num_threads()
        torch.set_num_threads(1)
        run_id = uuid.uuid4().hex[:8]
        ipc_dir = tempfile.mkdtemp(prefix="starling-sim-") if config.transport == "ipc" else ""
        furthest = [0]
        crashed: set[str] = set()

        def on_step(rank: int, step: int) -> None:
            furthest[0] = max(furthest[0], step)

        def make_peer(rank: int) -> SimPeer:
            return SimPeer(config, task, rank, endpoint_for(config.transport, rank, ipc_dir, run_id), on_step,
                           crashed)

        peers = [make_peer(rank) for rank in range(config.peers)]
        threads: list[threading.Thread] = []
        try:
            # the swarm's tables, kept out of the collector's full scans while they grow; not
            # frozen: this is the caller's process, which frees them after the run
            with building_heap(freeze=False):
                self._form(peers)
            for peer in peers:
                peer.create_protocol()
            t0 = time.time()
            for peer in peers:
                threads.append(threading.Thread(target=peer.train, args=(t0,), name=f"sim-peer-{peer.rank}",
                                                daemon=True))
                threads[-1].start()
            joins = sorted((e for e in config.churn if e.kind == "join"), key=lambda e: e.step)
            while any(t.is_alive() for t in threads):
                while joins and furthest[0] >= joins[0].step:
                    for _ in range(joins.pop(0).count):
                        live = [p for p in peers if p.result.status in ("running", "finished") and p.proto]
                        joiner = make_peer(len(peers))
                        peers.append(joiner)
                        threads.append(threading.Thread(target=self._join, args=(joiner, live, t0),
                                                        name=f"sim-peer-{joiner.rank}", daemon=True))
                        threads[-1].start()
                if self.progress is not None:
                    self.progress(furthest[0])
                time.sleep(0.05)
            if self.progress is not None:
                self.progress(furthest[0])
            return [p.result for p in peers], t0
        finally:
            close_together(peers)
            torch.set_num_threads(threads_before)

    def _form(self, peers: list[SimPeer]) -> None:
        """Start `peers` (the first, then the rest through it) and wait until each sees all."""
        config = self.config
        try:
            address = peers[0].start([])
        except OSError as exc:  # it could not listen: out of descriptors, a port taken
            raise SimError(f"the first peer could not start: {exc}") from None
        try:
            start_together(peers[1:], [address])
        except (JoinError, OSError) as exc:
            raise_if_faulted(peers)  # the failure behind it, if a node stopped on one
            raise SimError(f"a peer could not join: {exc}") from None
        sync_with_seed(peers, peers[0].node.peer_id, config.peers)
        # polled every 0.02 s for a few peers, less often for many (each poll asks every
        # node, on the network thread the swarm is forming on)
        wait_for(lambda: raise_if_faulted(peers)
                 and all(n == config.peers - 1
                         for n in on_network_thread(peers, lambda p: len(p.node.live_peers_here()))),
                 config.ready_timeout_s, f"{config.peers} peers to see each other",
                 interval_s=max(0.02, config.peers / 1000))

    @staticmethod
    def _join(joiner: SimPeer, live: list[SimPeer], t0: float) -> None:
        expected = {p.node.peer_id for p in live if p.result.status == "running"}
        if joiner.join_swarm([p.node.address for p in live], expected):
            joiner.train(t0)


def shares_swarm(run: SimConfig, baseline: SimConfig) -> bool:
    """Whether `baseline` can train on the swarm `run` formed (`Simulation.run_compared`): `run`
    has workers (processes on this machine, or Ray actors), one rank a peer, no churn and no
    time limit (every node is up and in the swarm when it ends), and `baseline` differs from it
    only in what a baseline changes (`SimConfig.baseline`): protocol, compressor, options,
    checkpoints."""
    if ((not run.processes and run.ray is None) or run.churn or run.duration_s or run.nproc_per_replica != 1
            or baseline.nproc_per_replica != 1 or baseline.protocol == run.protocol):
        return False
    return replace(baseline, protocol=run.protocol, compressor=run.compressor, options=run.options,
                   checkpoint_dir=run.checkpoint_dir, shard_sync=run.shard_sync) == run
