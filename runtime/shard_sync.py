"""Every rank syncs its own shard: FSDP2 inside a replica, one sub-swarm per shard rank.

A replica of N ranks trains its model under `torch.distributed.fsdp.fully_shard` (FSDP2:
NCCL on GPUs, gloo on the CPU): rank k holds dim-0 chunk k of every parameter, of its
gradient and of its inner optimizer's state, and gathers a layer's whole parameters only
while that layer computes. Each rank is its own Starling peer with its own node: rank k of
every replica forms one sub-swarm (its swarm config names `shard_rank: k`, so a node of
another rank is refused at join), and there it runs the protocol on its chunks alone. A
DiLoCo-family protocol thus keeps outer parameters and momentum for its chunks only and
averages them with rank k of the other replicas: a replica's outer-sync bytes leave through
all its ranks, and no rank holds the whole model or the whole outer state.

    model (FSDP2, DTensor parameters)  <- the loss runs through it (`ShardedModel.module`)
      rank k's chunk of each parameter = the same storage as
    view (plain module, local tensors) <- the protocol's model (`ShardedModel.view`)

The view's parameters alias the chunks: the protocol's in-place writes (an outer merge, a
joiner's fetched state) are what the next all-gather sends. Before each inner optimizer step
the view's gradients are pointed at the chunks of FSDP2's reduce-scattered gradients, and
after it both are dropped (as `zero_grad(set_to_none=True)` would): the inner step is plain
FSDP2's, on the same tensors.

Ranks of a replica must call the same collectives in the same order. Each step opens with
one all-reduce of a flag (`agree`): every rank goes on only if all want to, so a rank that
reached its step count, caught up past the others or was asked to stop ends the replica's
run there for all. Evaluation is a collective too (`evaluate`: every rank writes its outer
chunks into the model, the model runs, the chunks go back).

A rank that dies breaks the group: the others' next collective fails, and each leaves its
sub-swarm (`ReplicaError`), so the replica is gone from every shard's sub-swarm.

Buffers (batch-norm statistics) are not sharded: each rank keeps the whole set, and its
sub-swarm averages them as any peer's (the ranks of one replica may then hold slightly
different statistics between syncs).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from starling.runtime.modelspec import state_digest
from starling.runtime.replication import (
    REPLICA_RANKS_KEY,
    SHARD_RANK_KEY,
    ReplicaError,
    ReplicaGroup,
    Replication,
    check_replica_ranks,
    check_shard_rank,
)

if TYPE_CHECKING:
    from starling.protocols import Protocol, StepReport
    from starling.runtime.checkpoint import CheckpointConfig
    from starling.runtime.shard_checkpoints import ShardedCheckpoints
    from starling.tasks import Task

__all__ = ["SHARD_RANK_KEY", "ShardSync", "ShardedModel", "check_shard_rank", "fsdp_unavailable",
           "held_bytes", "rank_seeds", "share_rank_records", "share_seeds", "sub_swarm_config"]

log = logging.getLogger(__name__)



def fsdp_unavailable(device: str = "cpu") -> str | None:
    """Why FSDP2 cannot run on `device` with this torch (None: it can)."""
    if not dist.is_available():
        return "this torch was built without torch.distributed"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as exc:
        return f"this torch has no FSDP2 (torch.distributed.fsdp.fully_shard): {exc}"
    if device == "cpu" and not dist.is_gloo_available():
        return "this torch was built without gloo, which FSDP2 needs on the CPU"
    return None


class ShardSync(Replication):
    """A replica of many ranks under FSDP2, each rank a peer of its own that syncs its chunks
    of the model in the sub-swarm of its shard rank."""

    name = "shard-sync"

    def __init__(self, group: ReplicaGroup) -> None:
        super().__init__()
        self.group = group
        self.sharded: ShardedModel | None = None  # the model under FSDP2, and the view the protocol trains
        self.checkpoints: ShardedCheckpoints | None = None  # ... and its checkpoints (DCP, `shard_checkpoints.py`)
        self._steps = 0  # steps every rank of the replica took together: when they checkpoint

    @property
    def speaks(self) -> bool:
        return self.group.rank == 0

    def swarm_config(self) -> dict[str, Any]:
        return sub_swarm_config(self.group)

    def describe(self) -> dict[str, Any]:
        return {"replica_ranks": self.group.size, "shard_rank": self.group.rank}

    def check_swarm_config(self, config: dict[str, Any], first: bool) -> dict[str, Any]:
        if first:
            config = {REPLICA_RANKS_KEY: self.group.size, SHARD_RANK_KEY: self.group.rank, **config}
        check_replica_ranks(config, self.group.size)
        check_shard_rank(config, self.group.rank)
        return config

    def check_protocol(self, protocol: str, local_inner_steps: bool) -> str | None:
        if local_inner_steps:
            return None
        return (f"protocol {protocol!r} does not take its inner steps alone, so the ranks of a replica cannot each "
                "sync their own shard; use diloco or streaming-diloco")

    def place(self, model: Any, full: Any, checkpoint: CheckpointConfig | None) -> tuple[Any, Any]:
        self.sharded = ShardedModel(model, self.group)  # FSDP2 over the replica's ranks; the protocol gets my chunks
        if checkpoint is not None:
            from starling.runtime.shard_checkpoints import ShardedCheckpoints

            self.checkpoints = ShardedCheckpoints(checkpoint.directory, checkpoint.keep, self.sharded)
        return self.sharded.view, (self.sharded.view_of(full) if full is not None else None)

    def attach(self, proto: Protocol) -> None:
        assert self.sharded is not None, "place() first"
        self.sharded.attach(proto.optimizer)  # type: ignore[attr-defined]

    @property
    def forward_model(self) -> Any:
        return self.sharded.module if self.sharded is not None else None

    def step(self, take: Callable[[], StepReport]) -> StepReport:
        try:
            report = take()
        except Exception as exc:  # a rank died under a collective: the replica leaves every sub-swarm
            raise self.left(exc, "this rank left its sub-swarm") from exc
        self._steps += 1
        return report

    def agree(self, go: bool, snapshot: bool = False) -> tuple[bool, bool]:
        """Every rank's `go`, and whether any rank's joiner snapshot is due (one collective each
        rank calls before each step; a failed one leaves the sub-swarm). The ranks refresh
        their snapshots at the same steps, so a joining replica's ranks, each fetching from
        the same rank of a donor replica, find their chunks of one step."""
        low_go, low_not_due = self._all_min(int(go), -int(snapshot))
        return bool(low_go), low_not_due < 0

    def step_range(self, step: int) -> tuple[int, int]:
        """The least and the greatest step the replica's ranks hold (a collective)."""
        low, neg_high = self._all_min(step, -step)
        return low, -neg_high

    def _all_min(self, a: int, b: int) -> tuple[int, int]:
        """`ShardedModel.all_min`; a rank gone under it makes this rank leave its sub-swarm."""
        assert self.sharded is not None, "place() first"
        try:
            return self.sharded.all_min(a, b)
        except Exception as exc:
            raise self.left(exc, "this rank left its sub-swarm") from exc

    def evaluate(self, task: Task, model: Any) -> dict[str, float]:
        assert self.sharded is not None, "place() first"
        return self.sharded.evaluate(task, model)  # every rank of the replica evaluates together

    def steps_taken(self, proto: Protocol) -> int:
        return self._steps

    def stopped(self, proto: Protocol) -> dict[str, Any]:
        # what this rank's sub-swarm agreed on: its chunks of the swarm's model
        return {"shard": {"rank": self.group.rank, "ranks": self.group.size, "swarm": state_digest(proto.eval_model())}}

    def digests(self, proto: Protocol) -> dict[str, str]:
        assert self.sharded is not None, "place() first"
        return {"model": state_digest(self.sharded.view), "swarm": state_digest(proto.eval_model())}

    def has_own_checkpoints(self) -> bool:
        return self.checkpoints is not None

    def save_checkpoint(self, proto: Protocol, spec: Mapping[str, Any]) -> None:
        assert self.checkpoints is not None
        self.checkpoints.save(proto, spec, self._steps)  # every rank its chunks, at once (a collective)

    def latest_checkpoint(self) -> tuple[str, dict[str, Any]] | None:
        assert self.checkpoints is not None
        return self.checkpoints.latest()

    def load_checkpoint(self, path: str, manifest: Mapping[str, Any], proto: Protocol) -> int:
        assert self.checkpoints is not None
        step = self.checkpoints.load(path, proto)
        self._steps = int(manifest.get("count", step))
        return step


def local_chunk(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s chunk of `tensor` as FSDP2 shards it (`torch.chunk` along dim 0; a rank
    past the last chunk holds an empty one)."""
    if tensor.dim() == 0:
        raise ValueError("FSDP2 cannot shard a scalar parameter")
    chunks = torch.chunk(tensor, size, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return tensor.new_empty((0, *tensor.shape[1:]))


def _mirror(model: nn.Module, param_of: Any) -> nn.Module:
    """A plain module tree with `model`'s names: `param_of(name, p)` for each parameter, the
    model's own buffers (the same tensors)."""
    root = nn.Module()
    nodes = {"": root}
    made: dict[int, nn.Parameter] = {}  # a tied parameter is one parameter of the view too
    for name, module in model.named_modules():
        if name:
            parent, _, leaf = name.rpartition(".")
            nodes[name] = nn.Module()
            nodes[parent].add_module(leaf, nodes[name])
        node = nodes[name]
        for pname, p in module.named_parameters(recurse=False):
            if id(p) not in made:
                made[id(p)] = param_of(f"{name}.{pname}" if name else pname, p)
            node.register_parameter(pname, made[id(p)])
        for bname, b in module.named_buffers(recurse=False):
            persistent = bname not in getattr(module, "_non_persistent_buffers_set", ())
            node.register_buffer(bname, b, persistent=persistent)
    return root


def shard_units(model: nn.Module) -> list[nn.Module]:
    """Which modules FSDP2 gathers one at a time: the model's direct children that own
    parameters (a transformer's embedding, its blocks in a ModuleList, its head), then the
    root for whatever is left. Each unit's parameters are all-gathered just before it runs.
    A child that shares a parameter with another module (tied embeddings) stays in the root's
    unit, which gathers it once for both."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    tied = {i for i, n in owners.items() if n > 1}

    def shardable(module: nn.Module) -> bool:
        params = list(module.parameters())
        return bool(params) and not any(id(p) in tied for p in params)

    units: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, nn.ModuleList) or (isinstance(child, nn.Sequential) and len(child) > 1):
            units.extend(c for c in child if shardable(c))
        elif shardable(child):
            units.append(child)
    return units


class ShardedModel:
    """A model under FSDP2 across its replica's ranks, and the view of this rank's chunks
    that the protocol trains and syncs."""

    def __init__(self, model: nn.Module, group: ReplicaGroup) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        why = fsdp_unavailable(next(model.parameters()).device.type)
        if why is not None:
            raise ReplicaError(why)
        if any(p.dim() == 0 for p in model.parameters()):
            raise ReplicaError("the model has a scalar parameter, which FSDP2 cannot shard: run its replicas "
                               "without --shard-sync")
        self.group = group
        device = next(model.parameters()).device
        self.mesh = init_device_mesh(device.type, (group.size,))
        try:
            for unit in shard_units(model):
                fully_shard(unit, mesh=self.mesh)
            fully_shard(model, mesh=self.mesh)
        except (ValueError, TypeError, RuntimeError, AssertionError) as exc:
            raise ReplicaError(f"FSDP2 cannot shard this model: {exc}"[:500]) from None
        self.module = model

        def chunk(_name: str, p: torch.Tensor) -> nn.Parameter:
            with torch.no_grad():
                local = p.to_local() if hasattr(p, "to_local") else p
            return nn.Parameter(local, requires_grad=p.requires_grad)

        self.view = _mirror(model, chunk)
        self.pairs = [(p, v) for p, v in zip(model.parameters(), self.view.parameters())]
        self._pair = torch.zeros(2, dtype=torch.int64, device=device if group.backend == "nccl" else None)

    def view_of(self, full: nn.Module) -> nn.Module:
        """A module like `view` holding this rank's chunks of `full`'s parameters (a model of
        the same architecture, not under FSDP2)."""
        rank, size = self.group.rank, self.group.size
        return _mirror(full, lambda _n, p: nn.Parameter(local_chunk(p.detach(), rank, size),
                                                        requires_grad=p.requires_grad))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner optimizer (over the view's parameters) steps on FSDP2's gradient chunks."""
        optimizer.register_step_pre_hook(self._link_grads)
        optimizer.register_step_post_hook(self._drop_grads)

    def _link_grads(self, *_: Any) -> None:
        for p, v in self.pairs:
            g = p.grad
            v.grad = None if g is None else (g.to_local() if hasattr(g, "to_local") else g)

    def _drop_grads(self, *_: Any) -> None:
        for p, v in self.pairs:
            p.grad = None
            v.grad = None

    def agree(self, go: bool) -> bool:
        """Every rank of the replica calls this before each step: True only if all want to
        take it (a collective; ReplicaError if a rank is gone)."""
        return bool(self.all_min(int(go), 0)[0])

    def all_min(self, a: int, b: int) -> tuple[int, int]:
        """The least `a` and the least `b` over the replica's ranks, in one all-reduce (a
        collective; ReplicaError if a rank is gone). The greatest of a value is the least of
        its negation."""
        self._pair[0], self._pair[1] = a, b
        try:
            dist.all_reduce(self._pair, op=dist.ReduceOp.MIN)
        except Exception as exc:
            raise ReplicaError(f"a rank of this replica failed ({type(exc).__name__}: {str(exc)[:300]})") from exc
        low_a, low_b = self._pair.tolist()
        return int(low_a), int(low_b)

    @torch.no_grad()
    def evaluate(self, task: Any, swarm: nn.Module) -> dict[str, float]:
        """The task's metrics of the swarm's model (`swarm`: a module like `view` holding this
        rank's chunks of it), computed by every rank together through the sharded model: the
        chunks of `swarm` and of the view trade places for the evaluation, and back."""
        views = [v for _, v in self.pairs]
        theirs = list(swarm.parameters())
        if [t.shape for t in theirs] != [v.shape for v in views]:
            raise ValueError("the swarm's model does not hold this rank's chunks")
        self._swap(views, theirs)  # one parameter's copy at a time, not a second copy of the chunks
        try:
            with torch.enable_grad():  # the task decides; FSDP2 runs the same either way
                return task.evaluate(self.module)
        finally:
            self.reshard()
            self._swap(views, theirs)

    @staticmethod
    def _swap(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
        for x, y in zip(a, b):
            held = x.detach().clone()
            x.copy_(y)
            y.copy_(held)

    def reshard(self) -> None:
        """Free the gathered parameters a forward without backward leaves (FSDP2 keeps the
        root's after its forward, for the backward): they would go stale when the protocol
        writes the chunks, and the next forward would use them."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def chunk_bytes(self) -> int:
        """Bytes of this rank's parameter chunks."""
        return sum(v.numel() * v.element_size() for _, v in self.pairs)


def sub_swarm_config(group: ReplicaGroup) -> dict[str, Any]:
    """What a rank's node adds to its swarm config: its replica's size and its shard rank."""
    return {REPLICA_RANKS_KEY: group.size, SHARD_RANK_KEY: group.rank}


def held_bytes(proto: Any) -> dict[str, int]:
    """The training state a peer holds, by kind (bytes): its model's parameters, their
    gradients (as many bytes: they live through each step), its inner optimizer's state, a
    DiLoCo-family protocol's outer parameters and momentum, and its error-feedback residuals."""
    def size(obj: Any) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, Mapping):
            return sum(size(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(size(v) for v in obj)
        return 0

    optimizer = getattr(proto, "optimizer", None)
    parameters = size(list(proto.model.parameters()))
    return {"parameters": parameters, "gradients": parameters,
            "optimizer": size(list(optimizer.state.values())) if optimizer is not None else 0,
            "outer": size(list(getattr(proto, "outer", ()))) + size(list(getattr(proto, "momentum", ()))),
            "feedback": size(proto.private_state())}


# ---------------------------------------------------------------------- finding the sub-swarms
# Every rank of a replica serves this blob: the signed peer records of all its replica's ranks
# (msgpack, their wire form, by rank). A replica that joins knows only its seeds (other
# replicas' rank 0); its rank 0 joins them, reads the blob from members, and tells its ranks
# where the same rank of those replicas listens. Each record is signed by the rank it names:
# a replica vouches for no address its ranks did not sign.
RANKS_BLOB = "starling.replica.ranks"
RANKS_BLOB_MAX_BYTES = 1 << 20
RANKS_SOURCES = 3  # members whose replicas a joiner's ranks join through
RANKS_FETCH_S = 10.0


def share_rank_records(node: Any, group: ReplicaGroup) -> list[Any]:
    """Every rank calls this once its node is up (a collective): gathers the replica's signed
    records and serves them. Returns them (wire form, by rank; None for a rank that has none)."""
    import msgpack

    mine = node.record.to_wire() if node.record is not None else None
    records: list[Any] = [None] * group.size
    dist.all_gather_object(records, mine)
    blob = msgpack.packb(records, use_bin_type=True)
    node.serve_blob(RANKS_BLOB, lambda: blob)
    return records


def parse_rank_records(blob: bytes, size: int) -> list[tuple[str, ...]]:
    """Each rank's addresses from a replica's ranks blob; ValueError for one that is not a list
    of `size` records, each signed by the peer it names (None: a rank nobody can dial)."""
    import msgpack

    from starling.node.membership import PeerRecord

    try:
        records = msgpack.unpackb(blob, raw=False, max_bin_len=RANKS_BLOB_MAX_BYTES, max_array_len=4096)
    except Exception as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(records, list) or len(records) != size:
        raise ValueError(f"expected the records of {size} ranks")
    out = []
    for record in records:
        if record is None:
            out.append(())
            continue
        try:
            out.append(PeerRecord.from_wire(record).addresses)
        except Exception as exc:  # WireError: a bad field or signature
            raise ValueError(str(exc)) from None
    return out


def rank_seeds(node: Any, group: ReplicaGroup, deadline_s: float = RANKS_FETCH_S) -> list[list[str]]:
    """Rank 0 of a joining replica, once joined: where rank k of up to RANKS_SOURCES member
    replicas listens, for each k (read from their ranks blobs; a member that sends a bad one
    is skipped)."""
    import time

    seeds: list[list[str]] = [[] for _ in range(group.size)]
    answered = 0
    deadline = time.monotonic() + deadline_s
    for peer in sorted(node.live_peers()):
        if answered >= RANKS_SOURCES or time.monotonic() >= deadline:
            break
        try:
            _, blob = node.fetch_blob(RANKS_BLOB, [peer], deadline_s=max(0.1, deadline - time.monotonic()),
                                      max_bytes=RANKS_BLOB_MAX_BYTES)
            addresses = parse_rank_records(blob, group.size)
        except Exception as exc:
            log.warning("%s: no ranks of %s's replica: %s", node.peer_id, peer, exc)
            continue
        answered += 1
        for k, found in enumerate(addresses):
            seeds[k].extend(a for a in found if a not in seeds[k])
    return seeds


def share_seeds(group: ReplicaGroup, seeds: list[list[str]] | None) -> list[str]:
    """Rank 0 hands each rank its seeds (a collective: every rank calls it; the others pass None)."""
    box: list[Any] = [seeds]
    dist.broadcast_object_list(box, 0)
    got = box[0]
    return list(got[group.rank]) if got else []
