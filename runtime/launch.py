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
from starling.runtime.spec import (
    DATA_SCOPE_KEY,
    DATA_SCOPES,
    LOCAL_DATA_OPTIONS,
    TOKENIZER_KEY,
    tokenizer_fingerprint,
)
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
    `data_scope`: "local" when this peer trains its own data (its task options that name it,
    `LOCAL_DATA_OPTIONS`, stay out of the swarm's config; `runtime/spec.py`).

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
    data_scope: str = "swarm"
    tokenizer: str | None = None  # with data scope local: the fingerprint of this peer's tokenizer (`resolve`)

    def __post_init__(self) -> None:
        if self.data_scope not in DATA_SCOPES:
            raise ValueError(f"--data-scope {self.data_scope!r}: expected one of {', '.join(DATA_SCOPES)}")
        if self.data_scope == "local" and not self.task_options.get("data"):
            raise ValueError("--data-scope local trains this member's own data: give --data")
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
            # a member of a local swarm keeps the data it names now (its own, never in a checkpoint's config)
            own = {k: v for k, v in self.task_options.items() if k in LOCAL_DATA_OPTIONS} if saved.local else {}
            launch = replace(self, protocol=saved.protocol, task=saved.task,
                             options={**saved.options, **self.options},
                             task_options={**saved.task_options, **own}, seed=saved.seed,
                             data_scope=saved.data_scope)
        if launch.protocol is None:
            # a member of a local swarm names its data, so its task, whatever protocol it joins
            told = launch.task is not None or launch.task_options
            if launch.options or (told and not (launch.local and launch.joining)):
                raise ValueError("--task and protocol options need --protocol "
                                 "(or join a training swarm without them)")
        else:
            launch.spec().check()
        if launch.local:  # what the swarm checks of this member's own data: its tokenizer's content
            from starling.tasks import get_task

            fingerprint = tokenizer_fingerprint(get_task(launch.task or "gpt", **launch.task_options))
            launch = replace(launch, tokenizer=fingerprint)
        return launch

    @property
    def local(self) -> bool:
        """Whether this peer trains its own data (data scope local)."""
        return self.data_scope == "local"

    def own_data_options(self) -> dict[str, Any]:
        """The task options that name this peer's own data (empty unless data scope local)."""
        if not self.local:
            return {}
        return {k: v for k, v in self.task_options.items() if k in LOCAL_DATA_OPTIONS}

    def _swarm_task_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.task_options.items() if not (self.local and k in LOCAL_DATA_OPTIONS)}

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
                         self._swarm_task_options(), self.seed, self.data_scope, self.own_data_options(),
                         self.tokenizer)

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
                         "task_options": bool(self._swarm_task_options()), "seed": False,
                         DATA_SCOPE_KEY: True, TOKENIZER_KEY: True}
                wanted = {k: v for k, v in wanted.items() if given[k]}
                if "options" in wanted:
                    wanted["options"] = dict(self.options)
        if spec is None and self.local and self.joining:  # what it trains, compared with the swarm's
            wanted["task"] = self.task or "gpt"
            if self._swarm_task_options():
                wanted["task_options"] = self._swarm_task_options()
        if "data" in self.task_options:  # a swarm of the other data scope refuses it at hello
            wanted[DATA_SCOPE_KEY] = self.data_scope
            if self.local and self.tokenizer is not None:
                wanted[TOKENIZER_KEY] = self.tokenizer
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
