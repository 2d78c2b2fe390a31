"""One replica, many ranks: torch.distributed inside a replica, Starling between replicas.

A replica is a `torch.distributed` process group of N ranks (launched by `torchrun`, or
spawned by `starling node start --nproc-per-replica N`). Inner steps run under DDP (gloo on
the CPU, NCCL on GPUs). Rank 0, the leader, is the replica's one Starling peer: its Trainer
runs the protocol as any peer does, on the DDP-wrapped model, and only it talks to the swarm.
The other ranks, followers, take the same inner steps on their own batches: the same
gradients (DDP averaged them), the same inner optimizer and state, so the same parameters.

What the leader's protocol writes into the parameters besides the inner optimizer's step (an
outer merge, a catch-up, a joiner's fetched state) the followers cannot compute: the leader
finds such writes from the parameters' version counters (optimizer hooks mark where the
inner step begins and ends) and broadcasts its parameters, buffers and swarm model (the
protocol's `eval_model()`, the outer parameters for DiLoCo) right after. Every rank of the
replica then holds the same bits.

One control broadcast from the leader opens every step: GO (take an inner step) or STOP, and
whether a state broadcast follows. Followers thus never begin a step the leader will not
take, and stop where it stops, whatever made it stop (its step count, a signal, churn).

A rank that dies breaks the group: the others' next collective fails (gloo notices a closed
connection at once; otherwise after the group's timeout). The leader then leaves the swarm
cleanly (`ReplicaError`), and followers exit; the other replicas go on without this one. A
replica that starts again joins and fetches the swarm's state like any peer, then hands it
to its followers through the same broadcast.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from starling.common.lifeline import die_with_parent
from starling.runtime.modelspec import state_digest
from starling.runtime.placement import Placement
from starling.runtime.replication import (
    DEFAULT_TIMEOUT_S,
    REPLICA_RANKS_KEY,
    ReplicaError,
    ReplicaGroup,
    Replication,
    TrainingPlan,
    check_replica_ranks,
)
from starling.tasks import get_task

if TYPE_CHECKING:
    from starling.node import Node
    from starling.protocols import Protocol, StepReport

__all__ = ["DEFAULT_TIMEOUT_S", "REPLICA_RANKS_KEY", "Replica", "ReplicaError", "ReplicaGroup", "ReplicaLeader",
           "check_replica_ranks", "follow", "spawn_followers"]

log = logging.getLogger(__name__)

# Every this many steps (and at the first and the last) every rank digests its model and the
# leader gathers the digests, for `node status`: a host read and a hash of the whole model per
# rank, so not every step.
DIGEST_EVERY = 50
_GO, _STOP = 1, 0


@dataclass(frozen=True)
class ReplicaSetup:
    """What the leader tells its followers once: what to train, on which data, from which state."""

    task: str
    task_options: Mapping[str, Any]
    seed: int
    rank: int  # the leader's data shard; follower r takes rank + r
    world: int
    skip: int  # batches of the shard already trained (a resumed checkpoint's)
    placement: Placement
    optimizer: str  # "module:qualname" of the inner optimizer's class
    optimizer_defaults: Mapping[str, Any]
    optimizer_state: Mapping[str, Any]


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _wrap(model: nn.Module, placement: Placement) -> nn.Module:
    """`model` under DDP: one bucketed all-reduce of the gradients per backward."""
    from torch.nn.parallel import DistributedDataParallel

    device = placement.device
    ids = [device] if device is not None and device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def state_tensors(model: nn.Module, swarm: nn.Module) -> list[torch.Tensor]:
    """What a state broadcast carries: the parameters and buffers of the model and of the
    swarm's model, in module order."""
    return [*model.parameters(), *model.buffers(), *swarm.parameters(), *swarm.buffers()]


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Broadcast `tensors` from rank 0 in place: one flat buffer per dtype and device."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, 0)
        if dist.get_rank() != 0:
            for t, piece in zip(group, torch.split(flat, [t.numel() for t in group])):
                t.detach().copy_(piece.view_as(t))


def _control(command: int, dirty: bool, step: int, digest: bool, device: torch.device | None) -> torch.Tensor:
    return torch.tensor([command, int(dirty), step, int(digest)], dtype=torch.int64, device=device)


@dataclass(frozen=True)
class RankDigests:
    """What every rank of a replica held at the start of one step (after any state broadcast,
    before the inner step): digests of their models, in rank order."""

    step: int
    digests: tuple[str, ...]

    @property
    def agree(self) -> bool:
        return len(set(self.digests)) == 1

    def to_json(self) -> dict[str, Any]:
        return {"ranks": len(self.digests), "step": self.step, "agree": self.agree, "digests": list(self.digests)}


def gather_digests(model: nn.Module, step: int) -> RankDigests:
    """Every rank's model digest (a collective: every rank calls it at the same point)."""
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, state_digest(model))
    return RankDigests(step, tuple(str(d) for d in digests))


class Replica(Replication):
    """A replica of many ranks under DDP: this process is its rank 0, the swarm's one peer of
    the replica (the other ranks `follow`)."""

    name = "replica"

    def __init__(self, group: ReplicaGroup) -> None:
        super().__init__()
        self.group = group
        self.leader: ReplicaLeader | None = None

    def check_protocol(self, protocol: str, local_inner_steps: bool) -> str | None:
        if local_inner_steps:
            return None
        return (f"protocol {protocol!r} does not take its inner steps alone (its gradients or updates come from "
                "other peers), so a replica of many ranks cannot run it; use diloco or streaming-diloco")

    def lead(self, proto: Protocol, plan: TrainingPlan) -> None:
        if self.leader is None:
            assert self.node is not None, "bind() first"
            self.leader = ReplicaLeader(self.group, proto, plan, self.node)

    @property
    def forward_model(self) -> Any:
        return self.leader.ddp if self.leader is not None else None

    def step(self, take: Callable[[], StepReport]) -> StepReport:
        leader = self.leader
        if leader is None:
            return take()
        try:
            leader.before_step()
            report = take()
            leader.after_step()
        except Exception as exc:  # the ranks cannot agree on what comes next: the replica goes
            leader.finished = True
            raise self.left(exc, "the replica left the swarm") from exc
        return report

    def finish(self) -> None:
        if self.leader is not None:
            self.leader.finish()

    def stopped(self, proto: Protocol) -> dict[str, Any]:
        return self.status() or {}

    def status(self) -> dict[str, Any] | None:
        digests = self.leader.rank_digests if self.leader is not None else None
        return {"replica": digests.to_json()} if digests is not None else None

    def digests(self, proto: Protocol) -> dict[str, str]:
        return self.leader.digests() if self.leader is not None else {}


class ReplicaLeader:
    """Rank 0's side: wraps the protocol's model in DDP, opens every step with a control
    broadcast, and sends its state to the followers after any write they cannot compute."""

    def __init__(self, group: ReplicaGroup, proto: Protocol, plan: TrainingPlan, node: Node) -> None:
        self.group, self.proto, self.plan, self.node = group, proto, plan, node
        self.model: nn.Module = proto.model
        self.optimizer: torch.optim.Optimizer = proto.optimizer  # type: ignore[attr-defined]
        self._device = plan.placement.device
        self.finished = False
        self._sent: Any = None  # the last control broadcast, in flight
        cls = type(self.optimizer)
        setup = ReplicaSetup(plan.task, dict(plan.task_options), plan.seed, plan.rank, plan.world, plan.skip,
                             plan.placement, f"{cls.__module__}:{cls.__qualname__}", dict(self.optimizer.defaults),
                             self.optimizer.state_dict())
        dist.broadcast_object_list([setup], 0)
        proto.eval_model()  # its twin is a copy of the model: made before DDP hooks into the model
        self.ddp = _wrap(self.model, plan.placement)
        self._dirty = True  # the followers have none of my state yet
        self._orders = 0  # control broadcasts sent: every DIGEST_EVERY-th gathers the ranks' digests
        self.rank_digests: RankDigests | None = None  # the last gathered (`node status` shows them)
        self._clean: tuple[int, ...] = ()
        self._after_inner: tuple[int, ...] | None = None
        self._forwards = 0  # DDP averages the gradients of a loss that calls the model, no other
        self.ddp.register_forward_pre_hook(self._forwarded)
        self.optimizer.register_step_pre_hook(self._before_inner)
        self.optimizer.register_step_post_hook(self._after_inner_step)

    def _versions(self) -> tuple[int, ...]:
        """The parameters' version counters: any in-place write (a view's too) moves them."""
        return tuple(p._version for p in self.model.parameters())

    def _forwarded(self, *_: Any) -> None:
        self._forwards += 1

    def _before_inner(self, *_: Any) -> None:
        if self._versions() != self._clean:
            self._dirty = True

    def _after_inner_step(self, *_: Any) -> None:
        self._after_inner = self._versions()

    def before_step(self) -> None:
        """GO to the followers (with my state first, if it changed in a way they cannot follow)."""
        self._send(_GO)
        self._after_inner = None

    def after_step(self) -> None:
        """Note whether the protocol wrote the parameters after the inner step (an outer merge)."""
        if not self._forwards:
            raise ReplicaError(f"task {self.plan.task!r}'s loss does not call the model, so DDP cannot "
                               "average the ranks' gradients; a replica of many ranks needs a loss that does")
        self._forwards = 0
        now = self._versions()
        if now != (self._after_inner if self._after_inner is not None else self._clean):
            self._dirty = True
        self._clean = now

    def finish(self) -> None:
        """STOP to the followers (with my last state): every rank ends holding the same bits."""
        if self.finished:
            return
        self.finished = True
        try:
            self._send(_STOP)
        except Exception as exc:  # a rank died after the last step: nothing is left to tell it
            log.warning("%s: could not stop the replica's other ranks: %s: %s", self.node.peer_id,
                        type(exc).__name__, exc)

    def _send(self, command: int) -> None:
        dirty = self._dirty or self._versions() != self._clean
        step = self.proto.step_count
        # Sent without waiting for the followers to take it: the process group runs its
        # collectives in order, so the step's DDP all-reduce follows it anyway, and the leader
        # need not sit out a round trip every step. The last one's failure surfaces here.
        if self._sent is not None:
            self._sent.wait()
        digest = command == _STOP or self._orders % DIGEST_EVERY == 0
        self._orders += 1
        self._control_sent = _control(command, dirty, step, digest, self._control_device())  # alive until sent
        self._sent = dist.broadcast(self._control_sent, 0, async_op=True)
        if command == _STOP:
            self._sent.wait()
        if dirty:
            swarm = self.proto.eval_model()
            broadcast_tensors(state_tensors(self.model, swarm))
        if digest:
            self.rank_digests = gather_digests(self.model, step)
            if not self.rank_digests.agree:
                log.error("%s: the ranks of this replica hold different models at step %d: %s",
                          self.node.peer_id, step, list(self.rank_digests.digests))
        self._dirty = False
        self._clean = self._versions()

    def _control_device(self) -> torch.device | None:
        return self._device if self.group.backend == "nccl" else None

    def digests(self) -> dict[str, str]:
        """Digests of my model and of the swarm's, to compare with the followers'."""
        return {"model": state_digest(self.model), "swarm": state_digest(self.proto.eval_model())}


@dataclass
class FollowerResult:
    """What a follower did: the steps it took and digests of what it ends holding."""

    rank: int
    steps: int = 0
    model: str = ""  # state_digest of its model
    swarm: str = ""  # ... and of the swarm's model, as its leader last sent it

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _import_class(path: str) -> Any:
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _make_optimizer(setup: ReplicaSetup, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The leader's inner optimizer over `params`: its class, the defaults its constructor
    takes (the rest come back with its state's param groups), its state."""
    cls = _import_class(setup.optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    optimizer = cls(params, **{k: v for k, v in setup.optimizer_defaults.items() if k in accepted})
    optimizer.load_state_dict(setup.optimizer_state)
    return optimizer


class ReplicaFollower:
    """A rank > 0: the leader's inner steps on its own batches, the leader's state where the
    leader says so, until the leader says STOP."""

    def __init__(self, group: ReplicaGroup) -> None:
        received: list[Any] = [None]
        dist.broadcast_object_list(received, 0)
        setup: ReplicaSetup = received[0]
        self.placement = group.placement(setup.placement)
        self.group, self.setup = group, setup
        self.task = get_task(setup.task, **setup.task_options)
        self.model = self.placement.place(self.task.make_model())
        self.swarm = copy.deepcopy(self.model)
        self.ddp = _wrap(self.model, self.placement)
        self.optimizer = _make_optimizer(setup, _trainable(self.model))
        self.result = FollowerResult(group.rank)
        self._control = _control(0, False, 0, False, self.placement.device if group.backend == "nccl" else None)
        self._batches = self.batches()

    def batches(self) -> Iterator[Any]:
        rank, world = self.setup.rank + self.group.rank, self.setup.world
        return itertools.islice(self.task.batches(rank, world, self.setup.seed), self.setup.skip, None)

    def step(self) -> bool:
        """Take the leader's next order: its state if it sends it, then an inner step on my next
        batch (True), or STOP (False)."""
        placement, model = self.placement, self.model
        dist.broadcast(self._control, 0)
        command, dirty, step, digest = (int(v) for v in self._control.tolist())
        if dirty:
            broadcast_tensors(state_tensors(model, self.swarm))
        if digest:
            gather_digests(model, step)
        if command == _STOP:
            return False
        batch = placement.batch(next(self._batches), model)
        self.optimizer.zero_grad(set_to_none=False)
        with placement.autocast(model):
            loss = self.task.loss(self.ddp, batch)
        loss.backward()
        self.optimizer.step()
        self.result.steps = step + 1
        return True

    def run(self) -> FollowerResult:
        while self.step():
            pass
        self.result.model, self.result.swarm = state_digest(self.model), state_digest(self.swarm)
        return self.result


def follow(group: ReplicaGroup) -> FollowerResult:
    """A follower rank's whole life: rendezvous, train under the leader, leave the group."""
    group.init()
    try:
        return ReplicaFollower(group).run()
    finally:
        group.close()


def ignore_stop_signals() -> None:
    """A follower stops when its leader says so: Ctrl-C, which reaches every process of the
    terminal's group, stops the leader, and the leader then stops it. SIGTERM still ends it
    (multiprocessing ends a dead leader's daemons so, and waits for them)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _follower_main(group: ReplicaGroup, log_level: int) -> None:
    die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ignore_stop_signals()
    try:
        follow(group)
    except Exception as exc:  # its leader says why the replica stopped; this rank only that it did
        log.warning("replica rank %d stopped: %s: %s", group.rank, type(exc).__name__, exc)
        raise SystemExit(1) from None


def spawn_followers(size: int, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo",
                    directory: str | None = None) -> tuple[ReplicaGroup, list[Any]]:
    """`node start --nproc-per-replica N`: this process is rank 0; spawn ranks 1..N-1 (they
    rendezvous through a file in `directory`, by default a fresh temporary one that goes when
    this process exits). Returns the
    leader's group (not yet initialized) and the follower processes (daemons: they go with
    this process)."""
    import atexit
    import multiprocessing
    import shutil
    import tempfile

    if directory is None:
        # Removed when this process exits, whatever the path (a refusal, an error, SIGTERM,
        # which `node start` turns into an exit); the followers are joined or ended by then.
        directory = tempfile.mkdtemp(prefix="starling-replica-")
        atexit.register(shutil.rmtree, directory, True)
    init = f"file://{directory}/rendezvous"
    ctx = multiprocessing.get_context("spawn")
    level = logging.getLogger().getEffectiveLevel()
    procs = []
    for rank in range(1, size):
        proc = ctx.Process(target=_follower_main, name=f"replica-rank-{rank}", daemon=True,
                           args=(ReplicaGroup(rank, size, init, timeout_s, backend), level))
        proc.start()
        procs.append(proc)
    return ReplicaGroup(0, size, init, timeout_s, backend), procs
