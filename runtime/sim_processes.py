"""`starling simulate --processes`: one OS process per simulated peer, over tcp or ipc.

Each child runs one `SimPeer` (see `peer.py`) and reports to the parent through a queue:
its address, when it is ready, its step count and, at the end, its `PeerResult`. The
parent launches joiners when the churn schedule says so and collects the results.
"""
from __future__ import annotations

import logging
import multiprocessing
import queue
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starling.runtime.peer import SimPeer
from starling.runtime.simconfig import SimConfig, SimError, endpoint_for, wait_for
from starling.runtime.summary import PeerResult
from starling.tasks import get_task

log = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]


@dataclass
class _ProcessLink:
    """What the parent shares with every peer process."""

    # child -> parent: ("address", rank, addr) | ("ready", rank) | ("step", rank, n) | ("result", rank, PeerResult)
    queue: Any
    start: Any  # set when training starts; t0 holds its time.time()
    stop: Any  # set when every peer is done, so none disappears while others still train
    t0: Any
    ipc_dir: str


def _peer_process(config: SimConfig, rank: int, join: list[str], link: _ProcessLink, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    peer = SimPeer(config, get_task(config.task, **config.task_options), rank,
                   endpoint_for(config.transport, rank, link.ipc_dir, ""),
                   on_step=lambda r, step: link.queue.put(("step", r, step)))
    try:
        link.queue.put(("address", rank, peer.start(join)))
        if rank < config.peers:
            wait_for(lambda: len(peer.node.live_peers()) >= config.peers - 1, config.ready_timeout_s,
                     f"{config.peers} peers to see each other")
            peer.create_protocol()
            link.queue.put(("ready", rank))
            link.start.wait()
        else:
            assert config.liveness is not None  # Simulation.run sized it
            time.sleep(4 * config.liveness.heartbeat_interval_s)  # learn the rest of the table
            peer.create_protocol()
            peer.fetch_state()
        peer.train(link.t0.value)
        if peer.result.status == "finished":
            peer.collect()
    except Exception as exc:
        log.exception("peer process %d failed", rank)
        peer.result.status, peer.result.error = "failed", f"{type(exc).__name__}: {exc}"
    link.queue.put(("result", rank, peer.result))
    if peer.result.status == "finished":
        link.stop.wait(config.ready_timeout_s + 600)
    peer.close()


def run_processes(config: SimConfig, progress: ProgressFn | None) -> tuple[list[PeerResult], float]:
    """Spawn one process per peer (tcp/ipc on loopback) and collect their results."""
    ctx = multiprocessing.get_context("spawn")
    ipc_dir = tempfile.mkdtemp(prefix="starling-sim-") if config.transport == "ipc" else ""
    link = _ProcessLink(ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Value("d", 0.0), ipc_dir)
    procs: dict[int, Any] = {}
    addresses: dict[int, str] = {}
    results: dict[int, PeerResult] = {}
    ready: set[int] = set()
    furthest = 0
    joins = sorted((e for e in config.churn if e.kind == "join"), key=lambda e: e.step)

    def launch(rank: int, join: list[str]) -> None:
        procs[rank] = ctx.Process(target=_peer_process, name=f"sim-peer-{rank}", daemon=True,
                                  args=(config, rank, join, link, logging.getLogger().getEffectiveLevel()))
        procs[rank].start()

    def pump(timeout_s: float) -> None:
        nonlocal furthest
        try:
            message = link.queue.get(timeout=timeout_s)
        except queue.Empty:
            for rank, proc in procs.items():
                if rank not in results and proc.exitcode is not None:
                    results[rank] = PeerResult(rank, "", status="failed", error=f"process exited with {proc.exitcode}")
            return
        kind, rank = message[0], message[1]
        if kind == "address":
            addresses[rank] = message[2]
        elif kind == "ready":
            ready.add(rank)
        elif kind == "step":
            furthest = max(furthest, message[2])
        elif kind == "result":
            results[rank] = message[2]

    def until(cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + config.ready_timeout_s
        while not cond():
            if results and any(r.status == "failed" for r in results.values()):
                failed = next(r for r in results.values() if r.status == "failed")
                raise SimError(f"peer {failed.rank} failed: {failed.error}")
            if time.monotonic() > deadline:
                raise SimError(f"timed out after {config.ready_timeout_s:g} s waiting for {what}")
            pump(0.1)

    try:
        launch(0, [])
        until(lambda: 0 in addresses, "peer 0 to start")
        for rank in range(1, config.peers):
            launch(rank, [addresses[0]])
        until(lambda: len(ready) == config.peers, "the peer processes to form a swarm")
        link.t0.value = t0 = time.time()
        link.start.set()
        while len(results) < len(procs):
            while joins and furthest >= joins[0].step:
                for _ in range(joins.pop(0).count):
                    launch(len(procs), [a for r, a in addresses.items() if r not in results or
                                        results[r].status == "finished"])
            pump(0.1)
            if progress is not None:
                progress(furthest)
        return [results[rank] for rank in sorted(results)], t0
    finally:
        link.stop.set()
        for proc in procs.values():
            proc.join(timeout=15)
            if proc.is_alive():
                proc.kill()
