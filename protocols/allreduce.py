"""`allreduce`: exact data-parallel SGD, gradients averaged over all live peers every step.

    members = sorted(live peers + me)           # this peer's view at step t
    g = flatten(grad)                           # one float32 vector
    g = sharded_all_reduce(t, members, g)       # collectives/reduce.py: reduce-scatter by
                                                # shard owners, 2(P-1)/P of g sent per peer
    optimizer.step() on the averaged gradient   # a shard whose owner did not answer in
                                                # time keeps the local gradient

A peer that fell behind (a joiner whose state is a few rounds old) learns from the owners'
refusals which round the swarm is in and jumps there, so it costs the swarm one round.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from starling.collectives import ByteMeter, FlatModel, ReduceTimeouts, ShardedReducer, membership, watch_peers
from starling.node.node import Node
from starling.protocols.base import LossFn, Protocol, ProtocolConfig, ProtocolError, StepReport, register
from starling.protocols.optim import check_reduce_config, make_optimizer, optimizer_state

log = logging.getLogger(__name__)

PART_TOPIC = "allreduce.part"


@dataclass(frozen=True)
class AllReduceConfig(ProtocolConfig):
    optimizer: str = "sgd"  # sgd | adamw
    momentum: float = 0.0  # sgd only
    weight_decay: float = 0.0
    reply_grace_s: float = 2.0  # a member waits round_timeout_s + this for an owner's average
    retry_interval_s: float = 0.05  # re-send a part to an owner whose protocol is not up yet

    def __post_init__(self) -> None:
        check_reduce_config(self)


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
        self.meter = ByteMeter(node, "allreduce.")
        self._open = True
        timeouts = ReduceTimeouts(config.round_timeout_s, config.reply_grace_s, config.retry_interval_s)
        self.reducer = ShardedReducer(node, PART_TOPIC, self.flat.numel, config.compressor, timeouts,
                                      lambda: self._open)
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
        result = self.reducer.reduce(t, members, grad)
        if len(members) > 1:
            self.flat.scatter_grads(grad)
        if result.ahead > t:
            log.info("%s: allreduce round %d was late; catching up to round %d", self.node.peer_id, t, result.ahead)
            self.step_count = result.ahead
        step_start = time.monotonic()
        self.optimizer.step()
        compute_s += time.monotonic() - step_start
        self.step_count = max(self.step_count, t + 1)
        if result.lost:
            log.warning("%s: allreduce step %d went on without %s", self.node.peer_id, t, list(result.lost))
        sent, received = self.meter.take()
        return StepReport(step=t, loss=float(loss.detach()), bytes_sent=sent, bytes_received=received,
                          synced=result.synced, peers=result.peers, lost_peers=result.lost,
                          wall_s=time.monotonic() - start, compute_s=compute_s)

    # ------------------------------------------------------------------ hooks and state
    def on_peer_left(self, peer_id: str) -> None:
        self.reducer.peer_left(peer_id)

    def on_peer_joined(self, peer_id: str) -> None:
        self.reducer.peer_joined(peer_id)

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

