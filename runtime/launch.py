"""What one peer asks of the swarm it starts or joins: the swarm-config negotiation of
`starling node start`, for a Python caller as for the command.

The first node of a swarm fixes what the swarm trains (protocol, hyper-parameters, task and
seed: a `TrainSpec`), and says it at hello as its swarm config. A joiner insists only on what
it was told and learns the rest from the peer it joins; the swarm refuses one that insists on
something else (`SwarmConfigError`, raised by `Node.start`). A peer restarted from its
checkpoints without naming a protocol trains what they were written by.

    launch = NodeLaunch(protocol="diloco", options={"sync_every": 20}, steps=1000).resolve()
    if launch.may_train:
        prepare_to_train()
    node = Node().start(listen, join, swarm_config=launch.swarm_config())
    PeerRun(launch).run(node, stop)   # trains if launch.trains(node.swarm_config) (runtime/peer_run.py)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from starling.runtime.checkpoint import CheckpointError, CheckpointStore
from starling.runtime.replication import REPLICA_RANKS_KEY, SHARD_RANK_KEY, Replication
from starling.runtime.trainer import TrainSpec, with_run_length

DEFAULT_TASK = "charlm"  # what a first node that names no task trains


@dataclass(frozen=True)
class NodeLaunch:
    """What a starting peer asks of its swarm, before it says hello.

    `protocol`, `task`, `options` (protocol hyper-parameters, typed or as text),
    `task_options` and `seed` are what this peer was told; None and empty mean "not said".
    `joining`: it joins a swarm (then it learns what it was not told). `resume_from`: the
    directory of its checkpoints, when it restarts from them. `steps`: where it stops, which
    a protocol that plans over the run's length (sketch-dp) also plans for. `replica_ranks`:
    the ranks of this peer's replica (1 for a single process); every replica of a swarm has
    as many as its first. `shard_rank`: this process is that rank of a replica whose ranks
    each sync their own shard (`runtime/shard_sync.py`), a peer of that rank's sub-swarm.

    A launch of many ranks that will not train is refused at construction (ValueError); call
    `resolve()` for the launch this peer starts with.
    """

    protocol: str | None = None
    task: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    task_options: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    steps: int | None = None
    joining: bool = False
    resume_from: str | Path | None = None
    replica_ranks: int = 1
    shard_rank: int | None = None  # with every rank syncing its own shard: this rank's (its sub-swarm)

    def __post_init__(self) -> None:
        if self.replica_ranks < 1:
            raise ValueError(f"replica_ranks must be >= 1, got {self.replica_ranks}")
        if self.replica_ranks > 1 and not self.may_train:
            raise ValueError("a replica of many ranks trains: give --protocol (or --join a training swarm)")

    @property
    def may_train(self) -> bool:
        """Whether this peer may train: it names a protocol, joins a swarm that may train, or
        resumes. Such a peer says its replica's rank count at hello, and should pay torch's
        lazy start-up (`prepare_to_train`) before it does: from its hello on, the others count
        it in their rounds."""
        return self.protocol is not None or self.joining or self.resume_from is not None

    def resolve(self) -> NodeLaunch:
        """The launch this peer starts with, checked.

        A peer that resumes without naming a protocol or joining trains what its newest
        checkpoint's swarm trained: protocol, task, task options and seed come from there, and
        the protocol options it was given override the checkpoint's (a checkpoint of another
        swarm is then refused when it loads). Raises CheckpointError when no checkpoint names
        its swarm, ValueError for a task or options without a protocol, and ProtocolError or
        TaskSpecError naming a bad field of the spec.
        """
        launch = self
        if self.resume_from is not None and self.protocol is None and not self.joining:
            saved = newest_checkpoint_spec(self.resume_from)
            launch = replace(self, protocol=saved.protocol, task=saved.task,
                             options={**saved.options, **self.options}, task_options=dict(saved.task_options),
                             seed=saved.seed)
        if launch.protocol is None:
            if launch.task is not None or launch.options or launch.task_options:
                raise ValueError("--task and protocol options need --protocol "
                                 "(or join a training swarm without them)")
        else:
            launch.spec().check()
        return launch

    def replicated(self, replication: Replication) -> NodeLaunch:
        """This launch for a process of `replication` (`runtime/replica_launch.py`): its replica's
        rank count and, with every rank syncing its own shard, this rank's."""
        return replace(self, replica_ranks=replication.ranks,
                       shard_rank=replication.swarm_config().get(SHARD_RANK_KEY))

    def spec(self) -> TrainSpec | None:
        """What a first node with this launch fixes for its swarm (None without a protocol):
        the task defaults to charlm, and the run's length is filled in for a protocol that
        plans over it."""
        if self.protocol is None:
            return None
        return TrainSpec(self.protocol, self.task or DEFAULT_TASK, with_run_length(self.protocol, self.options,
                                                                                   self.steps),
                         dict(self.task_options), self.seed)

    def swarm_config(self) -> dict[str, Any] | None:
        """What this peer says at hello (`Node.start(swarm_config=...)`), None for nothing.

        A first node says its whole spec. A joiner says only what it was told: the protocol,
        and the task and options when given (its options as given, not the run length it
        filled in: its `steps` is only where it stops); the swarm's seed it always learns. A
        peer that may train also says its replica's rank count, so that a swarm of replicas
        of another size refuses it at hello, before it counts as a member.
        """
        spec = self.spec()
        wanted: dict[str, Any] = {}
        if spec is not None:
            wanted = spec.to_swarm_config()
            if self.joining:
                given = {"protocol": True, "task": self.task is not None, "options": bool(self.options),
                         "task_options": bool(self.task_options), "seed": False}
                wanted = {k: v for k, v in wanted.items() if given[k]}
                if "options" in wanted:
                    wanted["options"] = dict(self.options)
        if self.may_train:
            wanted[REPLICA_RANKS_KEY] = self.replica_ranks
            if self.shard_rank is not None:  # a node of another rank is refused at hello
                wanted[SHARD_RANK_KEY] = self.shard_rank
        return wanted or None

    def trains(self, swarm_config: Mapping[str, Any] | None) -> bool:
        """Whether this peer trains, once its node holds `swarm_config` (the swarm's, learned at
        join, or its own): it named a protocol, or the swarm it joined trains one."""
        return self.protocol is not None or bool((swarm_config or {}).get("protocol"))


def newest_checkpoint_spec(directory: str | Path) -> TrainSpec:
    """What the swarm that wrote the newest checkpoint in `directory` trained, from its
    manifest; CheckpointError when no checkpoint there names it."""
    found = CheckpointStore(directory).list()  # of every kind: a peer's file, a sharded replica's directory
    swarm = found[0].meta.get("swarm") if found else None
    if not isinstance(swarm, dict) or not swarm.get("protocol"):
        raise CheckpointError(f"no checkpoint in {directory} names the swarm it trained; "
                              "give --protocol (and --task) to start afresh")
    return TrainSpec.from_swarm_config(swarm)
