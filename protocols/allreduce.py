"""`allreduce`: exact data-parallel SGD, gradients averaged over all live peers every step.

Reduce-scatter by shard owners (hivemind's butterfly all-reduce), one request per shard:

    members  = sorted(live peers + me)                 # this peer's view at step t
    g        = flatten(grad)                           # one float32 vector
    split g into P = |members| contiguous shards; shard i is owned by members[i]
    for each shard i, in parallel:
        send shard i to its owner ("allreduce.part")   # the owner's reply is the average
    owner of shard i:
        sum the parts of (t, members, i) until every expected member has sent one,
            or round_timeout_s after the first part arrived
        reply to every contributor with (sum / count, contributors)
    shard whose average did not come back in time: keep the local gradient (owner reported lost)
    optimizer.step() on the averaged gradient

Each peer sends (P-1)/P of the vector as parts and (P-1)/P as averages: 2(P-1)/P in all,
the bandwidth-optimal figure. Every member decodes the same averaged packet, so replicas stay
bit-identical even under a lossy compressor (which gets error feedback in both directions).

Honesty about membership: a part names its sender's member list; an owner groups parts by
(step, member list, shard), so peers whose views disagree never mix shard boundaries. An owner
stops waiting for a member that it has seen contribute under a different view of the same step,
or that died or left; a member never waits past round_timeout_s + reply_grace_s.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from starling.compressors import Packet, decode
from starling.node.node import Node
from starling.node.rpc import RemoteError, Reply
from starling.node.wire import Message
from starling.protocols._exchange import (
    ByteMeter, FlatModel, check_compressor_spec, encode, make_codec, make_optimizer, membership,
    optimizer_state, packet_from_wire, watch_peers,
)
from starling.protocols.base import LossFn, Protocol, ProtocolConfig, ProtocolError, StepReport, register

log = logging.getLogger(__name__)

PART_TOPIC = "allreduce.part"
_KEEP_CLOSED_STEPS = 64  # how long an owner remembers finished rounds, to answer late parts


@dataclass(frozen=True)
class AllReduceConfig(ProtocolConfig):
    optimizer: str = "sgd"  # sgd | adamw
    momentum: float = 0.0  # sgd only
    weight_decay: float = 0.0
    reply_grace_s: float = 2.0  # a member waits round_timeout_s + this for an owner's average
    retry_interval_s: float = 0.05  # re-send a part to an owner whose protocol is not up yet

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        if not self.lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("round_timeout_s", "reply_grace_s", "retry_interval_s"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        check_compressor_spec(self.compressor)


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges, sizes differing by at most one."""
    base, extra = divmod(numel, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


GroupKey = tuple[int, tuple[str, ...], int]  # (step, members, shard)


@dataclass
class _ShardGroup:
    """An owner's accumulator for one shard of one round. Lives on the network thread."""

    members: tuple[str, ...]
    expected: set[str]
    deadline: float  # loop time
    contributors: list[str] = field(default_factory=list)
    total: torch.Tensor | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reply: tuple[dict[str, Any], tuple[torch.Tensor, ...]] | None = None

    def add(self, sender: str, part: torch.Tensor) -> None:
        if self.total is None:
            self.total = part.to(torch.float32, copy=True)
        else:
            self.total.add_(part)
        self.contributors.append(sender)

    def complete(self) -> bool:
        return self.expected <= set(self.contributors)


@dataclass(frozen=True)
class _ShardResult:
    shard: int
    owner: str
    packet: Packet | None  # the averaged shard; None: keep the local gradient
    contributors: tuple[str, ...] = ()
    reason: str = ""
    owner_step: int = -1  # the owner's latest round, when it refused a part as late


@register
class AllReduce(Protocol):
    name = "allreduce"
    config_class = AllReduceConfig
    config: AllReduceConfig

    def __init__(self, node: Node, model: nn.Module, config: AllReduceConfig) -> None:
        super().__init__(node, model, config)
        self.flat = FlatModel(model)
        self.optimizer = make_optimizer(self.flat.params, config.optimizer, config.lr,
                                        config.momentum, config.weight_decay)
        self.codec, self._part_feedback = make_codec(config.compressor)
        _, self._avg_feedback = make_codec(config.compressor)
        self.meter = ByteMeter(node, "allreduce.")
        # Network-thread state: open accumulators, finished keys, who used which view when.
        self._groups: dict[GroupKey, _ShardGroup] = {}
        self._closed: dict[GroupKey, int] = {}
        self._views: dict[tuple[int, str], tuple[str, ...]] = {}
        self._peer_step: dict[str, int] = {}  # the latest round each peer sent a part for
        self._gone: set[str] = set()
        self._latest_step = -1  # the latest round this peer has started
        self._open = True
        node.on(PART_TOPIC, self._on_part)
        watch_peers(node, self.on_peer_joined, self.on_peer_left, lambda: self._open)

    # ------------------------------------------------------------------ training thread
    def step(self, loss_fn: LossFn) -> StepReport:
        if not self._open:
            raise ProtocolError("allreduce: step() after close()")
        start = time.monotonic()
        self.optimizer.zero_grad(set_to_none=False)
        loss = loss_fn()
        loss.backward()
        grad = self.flat.gather_grads()
        compute_s = time.monotonic() - start

        t, members = self.step_count, membership(self.node)
        lost: set[str] = set()
        synced = False
        if len(members) > 1:
            results = self._all_reduce(t, members, grad)
            synced, lost = self._apply(members, grad, results)
            self.flat.scatter_grads(grad)
            self._catch_up(t, results)
        step_start = time.monotonic()
        self.optimizer.step()
        compute_s += time.monotonic() - step_start
        self.step_count = max(self.step_count, t + 1)
        if lost:
            log.warning("%s: allreduce step %d went on without %s", self.node.peer_id, t, sorted(lost))
        sent, received = self.meter.take()
        return StepReport(step=t, loss=float(loss.detach()), bytes_sent=sent, bytes_received=received,
                          synced=synced, peers=len(members) - len(lost), lost_peers=tuple(sorted(lost)),
                          wall_s=time.monotonic() - start, compute_s=compute_s)

    def _all_reduce(self, t: int, members: tuple[str, ...], grad: torch.Tensor) -> list[_ShardResult]:
        """Encode my parts here (off the network thread), then run the round there."""
        bounds = shard_bounds(grad.numel(), len(members))
        me = self.node.peer_id
        parts: list[torch.Tensor | Packet] = []
        for i, ((lo, hi), owner) in enumerate(zip(bounds, members)):
            if owner == me:
                parts.append(grad[lo:hi])  # my own part never crosses the wire
            else:
                parts.append(encode(self.codec, self._part_feedback, grad[lo:hi], f"part{i}/{len(members)}"))
        wait_s = self.config.round_timeout_s + self.config.reply_grace_s
        return self.node.run(self._around(t, members, parts), timeout_s=wait_s + 5.0)

    def _catch_up(self, t: int, results: list[_ShardResult]) -> None:
        """A peer that fell behind (e.g. a joiner whose state is a few rounds old) jumps to
        the round its owners are in, so that it costs the swarm one round, not every round."""
        ahead = max(r.owner_step for r in results)
        if ahead > t:
            log.info("%s: allreduce round %d was late; catching up to round %d", self.node.peer_id, t, ahead)
            self.step_count = ahead

    def _apply(self, members: tuple[str, ...], grad: torch.Tensor,
               results: list[_ShardResult]) -> tuple[bool, set[str]]:
        """Write each averaged shard over the local gradient; collect who was missing."""
        me, synced, lost = self.node.peer_id, False, set()
        for (lo, hi), res in zip(shard_bounds(grad.numel(), len(members)), results):
            if res.packet is None:
                log.info("%s: shard %d keeps its local gradient: %s", me, res.shard, res.reason)
                lost.add(res.owner)
                continue
            try:
                avg = decode(res.packet).reshape(-1)
                if avg.numel() != hi - lo:
                    raise ValueError(f"{avg.numel()} values for a shard of {hi - lo}")
            except Exception as exc:  # a bad reply costs one shard's average, not the step
                log.warning("%s: bad average for shard %d from %s: %s", me, res.shard, res.owner, exc)
                lost.add(res.owner)
                continue
            grad[lo:hi].copy_(avg)
            lost.update(set(members) - set(res.contributors))
            synced = synced or len(res.contributors) > 1
        lost.discard(me)
        return synced, lost

    # ------------------------------------------------------------------ network thread
    async def _around(self, t: int, members: tuple[str, ...],
                      parts: list[torch.Tensor | Packet]) -> list[_ShardResult]:
        me = self.node.peer_id
        self._latest_step = max(self._latest_step, t)
        deadline = asyncio.get_running_loop().time() + self.config.round_timeout_s + self.config.reply_grace_s
        jobs = []
        for i, (owner, part) in enumerate(zip(members, parts)):
            if owner == me:
                assert isinstance(part, torch.Tensor)
                jobs.append(self._reduce_own(t, members, i, part))
            else:
                assert isinstance(part, Packet)
                jobs.append(self._send_part(t, members, i, owner, part, deadline))
        results = await asyncio.gather(*jobs)
        self._forget_before(t - _KEEP_CLOSED_STEPS)
        return list(results)

    async def _reduce_own(self, t: int, members: tuple[str, ...], i: int, part: torch.Tensor) -> _ShardResult:
        me = self.node.peer_id
        reply, buffers = await self._reduce((t, members, i), me, part)
        if not reply["ok"]:
            return _ShardResult(i, me, None, reason=reply["reason"])
        return _ShardResult(i, me, Packet(reply["packet"], buffers), tuple(reply["contributors"]))

    async def _send_part(self, t: int, members: tuple[str, ...], i: int, owner: str, packet: Packet,
                         deadline: float) -> _ShardResult:
        loop = asyncio.get_running_loop()
        body = {"step": t, "shard": i, "members": list(members), "packet": packet.header}
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return _ShardResult(i, owner, None, reason="no average within the round timeout")
            try:
                msg = await self.node.arequest(owner, PART_TOPIC, body, packet.buffers, timeout_s=remaining)
            except RemoteError as exc:
                if "no handler" in str(exc):  # the owner's protocol is not up yet: try again
                    await asyncio.sleep(min(self.config.retry_interval_s, max(remaining, 0.0)))
                    continue
                return _ShardResult(i, owner, None, reason=str(exc))
            except Exception as exc:  # timeout, dead or unknown owner
                return _ShardResult(i, owner, None, reason=f"{type(exc).__name__}: {exc}")
            reply = msg.body
            if not isinstance(reply, dict) or not reply.get("ok"):
                reason = reply.get("reason") if isinstance(reply, dict) else "malformed reply"
                step = reply.get("step") if isinstance(reply, dict) else None
                step = step if isinstance(step, int) else -1
                if step > t:  # the owner has moved past this round: my groups stop waiting for it
                    self._saw_ahead(owner, step)
                return _ShardResult(i, owner, None, reason=f"owner refused: {reason}", owner_step=step)
            try:
                result = packet_from_wire(reply.get("packet"), msg.payload)
                contributors = tuple(str(c) for c in reply.get("contributors", ()))
            except Exception as exc:
                return _ShardResult(i, owner, None, reason=f"malformed average: {exc}")
            return _ShardResult(i, owner, result, contributors)

    async def _on_part(self, msg: Message) -> Reply | dict[str, Any]:
        """An owner receives one member's part; its answer is the shard's average."""
        me, body = self.node.peer_id, msg.body
        if not self._open:
            return _refuse("protocol closed")
        try:
            t, i, members = int(body["step"]), int(body["shard"]), tuple(str(m) for m in body["members"])
        except (TypeError, KeyError, ValueError):
            return _refuse("body must be {step, shard, members, packet}")
        if list(members) != sorted(set(members)) or msg.sender not in members:
            return _refuse("members must be sorted, unique, and include the sender")
        if not 0 <= i < len(members) or members[i] != me:
            return _refuse(f"this peer does not own shard {i} of that member list")
        key = (t, members, i)
        if key in self._closed or t < self._latest_step:
            return {**_refuse("late: the round already closed"), "step": self._latest_step}
        lo, hi = shard_bounds(self.flat.numel, len(members))[i]
        try:
            part = decode(packet_from_wire(body.get("packet"), msg.payload)).reshape(-1)
            if part.numel() != hi - lo or not bool(torch.isfinite(part).all()):
                raise ValueError(f"{part.numel()} values (finite or not) for a shard of {hi - lo}")
        except Exception as exc:
            return _refuse(f"bad part: {exc}")
        reply, buffers = await self._reduce(key, msg.sender, part)
        return Reply(reply, buffers)

    async def _reduce(self, key: GroupKey, sender: str,
                      part: torch.Tensor) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
        """Add a part to its group and wait for the group to close (all in, or timeout)."""
        t, members, _ = key
        if key in self._closed:
            return _refuse("late: the round already closed"), ()
        loop = asyncio.get_running_loop()
        group = self._groups.get(key)
        if group is None:
            others = {p for p in members if self._views.get((t, p), members) != members
                      or self._peer_step.get(p, t) > t}
            group = _ShardGroup(members, set(members) - self._gone - others,
                                loop.time() + self.config.round_timeout_s)
            self._groups[key] = group
        if sender in group.contributors:
            return _refuse("duplicate part"), ()
        group.add(sender, part)
        self._saw_view(t, sender, members)
        if group.complete():
            self._finish(key, group)
        if not group.done.is_set():
            try:
                await asyncio.wait_for(group.done.wait(), max(group.deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                self._finish(key, group)
        assert group.reply is not None
        return group.reply

    def _finish(self, key: GroupKey, group: _ShardGroup) -> None:
        if group.reply is not None:
            return
        assert group.total is not None
        t, members, i = key
        avg = group.total.div_(len(group.contributors))
        packet = encode(self.codec, self._avg_feedback, avg, f"avg{i}/{len(members)}")
        group.reply = ({"ok": True, "packet": packet.header, "contributors": list(group.contributors)},
                       packet.buffers)
        missing = group.expected - set(group.contributors)
        if missing:
            log.info("%s: shard %d of step %d closed without %s", self.node.peer_id, i, t, sorted(missing))
        group.done.set()
        self._groups.pop(key, None)
        self._closed[key] = t

    def _saw_view(self, t: int, sender: str, members: tuple[str, ...]) -> None:
        """A sender used `members` at step t: groups of other views of that step, and groups
        of earlier steps (it has moved past them), stop waiting for it."""
        self._views[(t, sender)] = members
        self._peer_step[sender] = max(self._peer_step.get(sender, t), t)
        for key, group in list(self._groups.items()):
            if key[0] < t or (key[0] == t and key[1] != members):
                self._stop_waiting_for(key, group, sender)

    def _saw_ahead(self, peer: str, step: int) -> None:
        """A peer said it is in round `step`: groups of earlier rounds stop waiting for it."""
        self._peer_step[peer] = max(self._peer_step.get(peer, step), step)
        for key, group in list(self._groups.items()):
            if key[0] < step:
                self._stop_waiting_for(key, group, peer)

    def _stop_waiting_for(self, key: GroupKey, group: _ShardGroup, peer: str) -> None:
        group.expected.discard(peer)
        if group.contributors and group.complete():
            self._finish(key, group)

    def _forget_before(self, step: int) -> None:
        self._closed = {k: t for k, t in self._closed.items() if t >= step}
        self._views = {k: v for k, v in self._views.items() if k[0] >= step}

    # ------------------------------------------------------------------ hooks and state
    def on_peer_left(self, peer_id: str) -> None:
        self._gone.add(peer_id)
        for key, group in list(self._groups.items()):
            self._stop_waiting_for(key, group, peer_id)

    def on_peer_joined(self, peer_id: str) -> None:
        self._gone.discard(peer_id)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["optimizer"] = optimizer_state(self.optimizer)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        self._open = False

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "step": self.step_count, "parameters": self.flat.numel}


def _refuse(reason: str) -> dict[str, Any]:
    return {"ok": False, "reason": reason}
