"""How a peer's model is held by its processes: the replication a peer runs under.

    Single     one process holds the whole model (the default)
    Replica    a replica of N ranks under DDP; rank 0 alone is the swarm's peer
               (`runtime/replica.py`)
    ShardSync  a replica of N ranks under FSDP2; every rank is a peer of its own and syncs its
               own shard with the same rank of the other replicas (`runtime/shard_sync.py`)

A `Trainer` takes one and asks it wherever the three differ: the data shard a rank reads, what
its node's swarm config says and checks, how the model is placed (FSDP2 wraps it), how a step
is taken and what a failed one means, whether every rank takes the next step, how the model is
evaluated, and where a replica's own checkpoints go. `PeerRun` and the simulator's peers hand it
over; `runtime/replica_launch.py` makes the right one for a process (spawning or joining the
ranks), for `starling node start` as for a Python caller.

This module holds what all three share (the group a rank belongs to, the swarm-config key of
the replica size), so that the trainer imports none of the replica modules and they import
nothing of the trainer.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starling.runtime.placement import Placement

if TYPE_CHECKING:
    from starling.node import Node
    from starling.protocols import Protocol, StepReport
    from starling.runtime.checkpoint import CheckpointConfig
    from starling.tasks import Task

__all__ = ["DEFAULT_TIMEOUT_S", "REPLICA_RANKS_KEY", "SHARD_RANK_KEY", "ReplicaError", "ReplicaGroup", "Replication",
           "Single", "TrainingPlan", "check_replica_ranks", "check_shard_rank"]

log = logging.getLogger(__name__)

REPLICA_RANKS_KEY = "replica_ranks"  # in the swarm config: every replica of a swarm has this many ranks
SHARD_RANK_KEY = "shard_rank"  # in the swarm config: the shard rank of every peer of a sharded sub-swarm
DEFAULT_TIMEOUT_S = 300.0  # a rank waits this long for the others (a joiner's fetch, a slow round)


class ReplicaError(RuntimeError):
    """A rank of this replica failed (the replica has left the swarm), or this replica cannot
    run in this swarm."""


def check_replica_ranks(swarm_config: Mapping[str, Any] | None, ranks: int) -> None:
    """ReplicaError unless the swarm's replicas have `ranks` ranks (a swarm that never said
    has replicas of one rank: single-process peers)."""
    swarm = int((swarm_config or {}).get(REPLICA_RANKS_KEY, 1))
    if swarm != ranks:
        raise ReplicaError(f"the swarm's replicas have {swarm} rank{'s' if swarm != 1 else ''} each and this one "
                           f"has {ranks}: start it with --nproc-per-replica {swarm}")


def check_shard_rank(swarm_config: Mapping[str, Any] | None, shard_rank: int | None) -> None:
    """ReplicaError unless this peer's shard rank (None: it syncs whole models) is the swarm's."""
    swarm = (swarm_config or {}).get(SHARD_RANK_KEY)
    if swarm is None and shard_rank is None:
        return
    if shard_rank is None:
        raise ReplicaError(f"this swarm is the sub-swarm of shard rank {swarm} (every rank of a replica syncs its "
                           "own shard); a peer that syncs whole models cannot join it: start it with --shard-sync")
    if swarm != shard_rank:
        where = "a swarm of whole models" if swarm is None else f"the sub-swarm of shard rank {swarm}"
        raise ReplicaError(f"this is rank {shard_rank} of its replica, and {where} is not its own: "
                           f"join rank {shard_rank} of a replica in the swarm")


@dataclass(frozen=True)
class TrainingPlan:
    """What a peer trains, as its replica's other ranks need it: the task, its data shard (the
    peer's: rank r of the replica takes `rank * ranks + r`), the batches of it already trained
    and the placement."""

    task: str
    task_options: Mapping[str, Any]
    seed: int
    rank: int
    world: int
    skip: int
    placement: Placement


@dataclass(frozen=True)
class ReplicaGroup:
    """This process's place in its replica's process group."""

    rank: int
    size: int
    init_method: str  # "env://" under torchrun, "file://..." when Starling spawned the ranks
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: str = "gloo"  # "nccl" when the ranks train on GPUs
    local_rank: int | None = None  # this rank's GPU on its host (torchrun's LOCAL_RANK); None: rank

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"replica rank {self.rank} of {self.size}: need 0 <= rank < size")
        if not self.timeout_s > 0:
            raise ValueError(f"the replica's timeout must be > 0 s, got {self.timeout_s}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, timeout_s: float = DEFAULT_TIMEOUT_S,
                 backend: str = "gloo") -> ReplicaGroup | None:
        """The group `torchrun` set up (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or None
        outside torchrun or with one rank."""
        if int(env.get("WORLD_SIZE", "1")) <= 1:
            return None
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), "env://", timeout_s, backend,
                   int(env.get("LOCAL_RANK", env["RANK"])))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def shard(self, rank: int, world: int) -> tuple[int, int]:
        """This rank's data shard, given its replica's shard `rank` of `world`."""
        return rank * self.size + self.rank, world * self.size

    def placement(self, placement: Placement) -> Placement:
        """`placement` for this rank: on its own GPU when the replica trains on GPUs."""
        import torch

        device = placement.device
        if device is None or device.type != "cuda":
            return placement
        return dataclasses.replace(placement, device=torch.device("cuda", self.rank if self.local_rank is None
                                                                  else self.local_rank))

    def init(self) -> None:
        """Rendezvous with the replica's other ranks (bounded by the timeout)."""
        import torch
        import torch.distributed as dist

        if self.backend == "nccl":
            torch.cuda.set_device(self.placement(Placement(device=torch.device("cuda"))).device)
        dist.init_process_group(self.backend, init_method=self.init_method, rank=self.rank, world_size=self.size,
                                timeout=datetime.timedelta(seconds=self.timeout_s))

    @staticmethod
    def close() -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class Replication:
    """How a peer's model is held: the base class is `Single`'s behaviour, one process holding
    the whole model. A subclass overrides what its replica does differently; every method is
    called by the `Trainer` (or `PeerRun`) of this process's peer, which `bind`s it first."""

    name = "single"
    group: ReplicaGroup | None = None

    def __init__(self) -> None:
        self.node: Node | None = None

    # ------------------------------------------------------------------ who and what
    @property
    def ranks(self) -> int:
        """The ranks of this peer's replica (every replica of a swarm has as many)."""
        return self.group.size if self.group is not None else 1

    @property
    def speaks(self) -> bool:
        """Whether this process says what the peer does (progress lines): one per replica."""
        return True

    def shard(self, rank: int, world: int) -> tuple[int, int]:
        """This process's data shard, given its peer's shard `rank` of `world`."""
        return (rank, world) if self.group is None else self.group.shard(rank, world)

    def swarm_config(self) -> dict[str, Any]:
        """What this process's node adds to the swarm config it says hello with."""
        return {REPLICA_RANKS_KEY: self.ranks} if self.ranks > 1 else {}

    def describe(self) -> dict[str, Any]:
        """What the "training" record says of the replica."""
        return {"replica_ranks": self.ranks} if self.group is not None else {}

    def bind(self, node: Node) -> None:
        """The node of this process's peer (a failed replica leaves through it)."""
        self.node = node

    def check_swarm_config(self, config: dict[str, Any], first: bool) -> dict[str, Any]:
        """The swarm config with this replica's keys, when its peer is the swarm's `first`
        (its model fixes the swarm's); else ReplicaError unless the swarm's replicas match."""
        if first and self.ranks > 1 and REPLICA_RANKS_KEY not in config:
            config = {**config, REPLICA_RANKS_KEY: self.ranks}
        check_replica_ranks(config, self.ranks)
        check_shard_rank(config, None)
        return config

    # ------------------------------------------------------------------ the model
    def check_protocol(self, protocol: str, local_inner_steps: bool) -> str | None:
        """Why `protocol` cannot run under this replication (None: it can)."""
        return None

    def place(self, model: Any, full: Any, checkpoint: CheckpointConfig | None) -> tuple[Any, Any]:
        """The model the protocol trains and its full-precision copy (or None), from the placed
        model and that copy."""
        return model, full

    def attach(self, proto: Protocol) -> None:
        """The protocol is built on the model `place` gave."""

    def lead(self, proto: Protocol, plan: TrainingPlan) -> None:
        """The peer's starting state is loaded: a replica's other ranks take it from here on,
        and train `plan` alongside."""

    @property
    def forward_model(self) -> Any:
        """The module the loss runs through, when not the protocol's model (DDP's, FSDP2's)."""
        return None

    # ------------------------------------------------------------------ the steps
    def step(self, take: Callable[[], StepReport]) -> StepReport:
        """Take one protocol step (`take()`), as every rank of the replica must."""
        return take()

    def agree(self, go: bool, snapshot: bool = False) -> tuple[bool, bool]:
        """Whether to take the next step, given this process's `go` (a replica: every rank's),
        and whether to refresh the snapshot joiners fetch after it, given this process's
        `snapshot` (a replica whose ranks serve their own parts: any rank's, so all refresh
        at the same step)."""
        return go, snapshot

    def step_range(self, step: int) -> tuple[int, int]:
        """The least and the greatest step the replica's ranks hold, given this process's
        `step` (a collective where each rank holds its own state)."""
        return step, step

    def evaluate(self, task: Task, model: Any) -> dict[str, float]:
        return task.evaluate(model)

    def steps_taken(self, proto: Protocol) -> int:
        """The steps checkpoints count (a sharded replica's ranks write at the steps they took
        together)."""
        return proto.step_count

    def finish(self) -> None:
        """The peer stops here: a replica's other ranks stop with it."""

    def stopped(self, proto: Protocol) -> dict[str, Any]:
        """What the "stopped" record says of the replica."""
        return {}

    def status(self) -> dict[str, Any] | None:
        """What `node status` says of the replica (None: nothing new)."""
        return None

    def digests(self, proto: Protocol) -> dict[str, str]:
        """Digests of this rank's model and of the swarm's (compared across a replica's ranks)."""
        return {}

    # ------------------------------------------------------------------ a replica's own checkpoints
    def has_own_checkpoints(self) -> bool:
        """Whether this replica writes its own checkpoints (every rank its part) instead of the
        peer's one file."""
        return False

    def save_checkpoint(self, proto: Protocol, spec: Mapping[str, Any]) -> None:
        raise NotImplementedError(f"a {self.name} peer writes no checkpoints of its own")

    def latest_checkpoint(self) -> tuple[str, dict[str, Any]] | None:
        raise NotImplementedError(f"a {self.name} peer writes no checkpoints of its own")

    def load_checkpoint(self, path: str, manifest: Mapping[str, Any], proto: Protocol) -> int:
        raise NotImplementedError(f"a {self.name} peer writes no checkpoints of its own")

    def left(self, exc: BaseException, what: str) -> ReplicaError:
        """A collective of this replica failed: leave the swarm cleanly and say why (`what`:
        what this process left)."""
        node = self.node
        log.error("%s: a rank of this replica of %d failed (%s: %s); leaving", node.peer_id if node else "-",
                  self.ranks, type(exc).__name__, str(exc)[:300])
        if node is not None:
            try:
                node.leave()
            except Exception as leave_exc:  # already closed: the others see it as a crash instead
                log.warning("%s: could not leave cleanly: %r", node.peer_id, leave_exc)
        why = str(exc) if isinstance(exc, ReplicaError) else \
            f"a rank of this replica failed ({type(exc).__name__}: {str(exc)[:300]})"
        return ReplicaError(f"{why}; {what}")


class Single(Replication):
    """One process holds the whole model."""
