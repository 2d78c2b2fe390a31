"""Starting a peer's replica: this process's part in it, and the ranks it spawns.

`starling node start --nproc-per-replica N [--shard-sync]` and a Python caller go through the
same path:

    launch = launch_replica(2, shard_sync=False)        # spawns rank 1, this process is rank 0
    if launch.follows:                                   # a DDP rank > 0 (under torchrun)
        launch.follow(); return
    launch.init()                                        # the ranks' rendezvous
    node = Node().start(launch.listen(listen), launch.seeds(join), swarm_config=...)
    launch.node_started(node, joined=bool(join))
    PeerRun(...).run(node, stop, replication=launch.replication)
    launch.close()

Under `torchrun` the ranks are torchrun's; otherwise rank 0 spawns the others. Under DDP
(`Replica`) the other ranks are followers that train under rank 0's orders. Under FSDP2
(`ShardSync`) every rank is a peer of its own and runs this same program again (`argv`), told
its rank as torchrun would tell it; a joining replica's rank 0 then finds where rank k of the
swarm's replicas listens and hands each rank its seeds.
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starling.common.lifeline import die_with_parent
from starling.runtime.replica import Replica, follow, ignore_stop_signals, spawn_followers
from starling.runtime.replication import DEFAULT_TIMEOUT_S, REPLICA_RANKS_KEY, ReplicaGroup, Replication, Single
from starling.runtime.shard_sync import ShardSync, rank_seeds, share_rank_records, share_seeds

__all__ = ["SPAWNED_RANK_ENV", "ReplicaLaunch", "check_replica_size", "launch_replica", "rank_endpoint"]

log = logging.getLogger(__name__)

SPAWNED_RANK_ENV = "STARLING_SPAWNED_RANK"  # a rank that `launch_replica` started (it keeps its nproc option)
SIZE_CHECK_SEEDS, SIZE_CHECK_TIMEOUT_S = 2, 3.0  # seeds asked before a replica spawns its ranks, each for so long


class _RankProcess:
    """A rank spawned to run this program again, joined as a multiprocessing process would be."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class ReplicaLaunch:
    """This process's part in its peer's replica: its `replication`, and the ranks it spawned."""

    replication: Replication
    spawned: list[Any] = field(default_factory=list)

    @property
    def group(self) -> ReplicaGroup | None:
        return self.replication.group

    @property
    def follows(self) -> bool:
        """Whether this process is a DDP rank > 0: it trains under rank 0's orders (`follow`)
        and is no peer of the swarm."""
        return isinstance(self.replication, Replica) and self.group is not None and not self.group.is_leader

    def follow(self) -> None:
        """A follower's whole life: rendezvous, train under rank 0, leave the group."""
        ignore_stop_signals()
        assert self.group is not None
        follow(self.group)

    def init(self) -> None:
        """Rendezvous with the replica's other ranks (bounded by the group's timeout)."""
        if self.group is not None:
            self.group.init()

    def listen(self, endpoints: Sequence[str]) -> list[str]:
        """Where this rank's node listens: with shard sync each rank is a node of its own, and an
        explicit tcp port is rank 0's (rank k listens on it + k)."""
        if isinstance(self.replication, ShardSync):
            return [rank_endpoint(endpoint, self.replication.group.rank) for endpoint in endpoints]
        return list(endpoints)

    def seeds(self, join: Sequence[str]) -> list[str]:
        """Whom this rank's node joins: with shard sync, rank k > 0 joins rank k of the replicas
        its rank 0 joined (a collective with `node_started` of rank 0)."""
        replication = self.replication
        if not isinstance(replication, ShardSync) or replication.group.rank == 0:
            return list(join)
        seeds = share_seeds(replication.group, None)
        if join and not seeds:
            from starling.node.join import JoinError

            raise JoinError(f"the replicas this replica's rank 0 joined named no address of their rank "
                            f"{replication.group.rank}")
        return seeds

    def node_started(self, node: Any, joined: bool) -> None:
        """This rank's node is up: with shard sync, rank 0 of a joining replica tells the other
        ranks where to join, and every rank serves the replica's signed records."""
        replication = self.replication
        if not isinstance(replication, ShardSync):
            return
        if replication.group.rank == 0:
            share_seeds(replication.group, rank_seeds(node, replication.group) if joined else None)
        share_rank_records(node, replication.group)

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave the replica's group; the ranks spawned here stopped where this one did."""
        if self.group is not None:
            self.group.close()
        for rank in self.spawned:
            rank.join(timeout=timeout_s)


def launch_replica(nproc: int = 1, *, shard_sync: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                   device: str | None = None, argv: Sequence[str] | None = None) -> ReplicaLaunch:
    """This process's part in a replica of `nproc` ranks: torchrun's ranks (from its
    environment), or rank 0 of `nproc` ranks spawned here; a `Single` peer for one process.

    Under DDP the ranks spawned here are followers (multiprocessing, spawn). With `shard_sync`
    every rank is a whole peer: the ranks spawned here run `argv` (by default this program,
    `sys.argv` under this interpreter) with torchrun's variables. The spawned ranks go when
    this process goes. ValueError for a combination that cannot run."""
    backend = "nccl" if device is not None and device.startswith("cuda") else "gloo"
    group = ReplicaGroup.from_env(timeout_s=timeout_s, backend=backend)
    if os.environ.get(SPAWNED_RANK_ENV):
        die_with_parent()  # a rank spawned here ends with the process that spawned it
    if group is not None:
        if nproc > 1 and not os.environ.get(SPAWNED_RANK_ENV):
            raise ValueError("under torchrun the replica's ranks are torchrun's (--nproc-per-node): drop "
                             "--nproc-per-replica")
        return ReplicaLaunch(ShardSync(group) if shard_sync else Replica(group))
    if nproc == 1:
        if shard_sync:
            raise ValueError("--shard-sync splits a replica's model over its ranks: give --nproc-per-replica 2 or "
                             "more (or run under torchrun)")
        return ReplicaLaunch(Single())
    if shard_sync:
        group, spawned = _spawn_ranks(nproc, timeout_s, backend, argv)
        return ReplicaLaunch(ShardSync(group), spawned)
    group, spawned = spawn_followers(nproc, timeout_s, backend)
    return ReplicaLaunch(Replica(group), spawned)


def _spawn_ranks(nproc: int, timeout_s: float, backend: str,
                 argv: Sequence[str] | None) -> tuple[ReplicaGroup, list[Any]]:
    """Ranks 1..nproc-1 run `argv` with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT on loopback); this process is rank 0. They go when it exits."""
    with socket.socket() as probe:  # a free port for the group's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    command = list(argv) if argv is not None else _this_program()
    procs = []
    for rank in range(1, nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               SPAWNED_RANK_ENV: "1"}
        procs.append(_RankProcess(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)))

    def end() -> None:
        for rank in procs:
            if rank.proc.poll() is None:
                rank.proc.terminate()
    atexit.register(end)
    return ReplicaGroup(0, nproc, "env://", timeout_s, backend, 0), procs


def _this_program() -> list[str]:
    """This process's command line, to run again: the `starling` command as a module (its
    entry script may not be on PATH), a script as itself."""
    script = Path(sys.argv[0]).name if sys.argv else ""
    if script in ("starling", "starling.exe") or sys.argv[0].endswith("starling/cli/main.py"):
        return [sys.executable, "-m", "starling.cli.main", *sys.argv[1:]]
    return [sys.executable, *sys.argv]


def rank_endpoint(endpoint: str, rank: int) -> str:
    """`endpoint` for rank `rank` of a replica whose ranks are nodes of their own: an explicit
    tcp port + rank (port 0 stays 0: each picks a free one)."""
    head, sep, port = endpoint.rpartition(":")
    if not rank or not endpoint.startswith("tcp://") or not sep or not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{head}:{int(port) + rank}"


def check_replica_size(seeds: Sequence[str], ranks: int, key: Path | None = None) -> None:
    """Before a replica spawns its ranks: the first seed that answers a status names the
    replica size of its swarm, and a replica of another size stops here (SwarmConfigError),
    with the line its hello would get after its ranks had started (on a GPU box, each loading
    CUDA to be told no). Where no seed answers (down, allowlisted, busy), the hello still checks."""
    from starling.node.client import query
    from starling.node.identity import Identity
    from starling.node.join import SwarmConfigError, config_conflict_text, config_conflicts

    identity = Identity.load(key) if key is not None else None
    for seed in list(seeds)[:SIZE_CHECK_SEEDS]:
        try:
            status = query(seed, identity=identity, timeout_s=SIZE_CHECK_TIMEOUT_S)
        except Exception:  # anything from an address or a node: the hello decides
            continue
        config = status.get("config") if isinstance(status, dict) else None
        swarm_ranks = config.get(REPLICA_RANKS_KEY) if isinstance(config, dict) else None
        if isinstance(swarm_ranks, int) and not isinstance(swarm_ranks, bool):
            conflicts = config_conflicts({REPLICA_RANKS_KEY: swarm_ranks}, {REPLICA_RANKS_KEY: ranks})
            if conflicts:
                raise SwarmConfigError(f"{config_conflict_text(conflicts)} (asked {seed} before starting "
                                       "this replica's ranks)")
        return
