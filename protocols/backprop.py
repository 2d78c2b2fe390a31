"""What the backprop protocols (allreduce, gossip, DiLoCo, sketch-dp) share: the model's
trainable parameters as one flat float32 vector, a torch optimizer over them, the backward
pass that begins each local step, and, for those whose peers hold the same parameters, the
drift guard that compares and repairs them (`guard.py`)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from starling.collectives import FlatModel
from starling.collectives.agreement import digest_bytes
from starling.protocols.base import LossFn, Protocol, ProtocolConfig
from starling.protocols.guard import DriftGuard, State
from starling.protocols.optim import (
    make_optimizer,
    optimizer_from_wire,
    optimizer_state,
    optimizer_to_wire,
    reduce_timeouts,
)

if TYPE_CHECKING:
    from starling.node.node import Node


class BackpropProtocol(Protocol):
    """A protocol whose local step is backprop and a torch optimizer step over `flat.params`.
    Its `state_dict` holds the optimizer's state too, under `optimizer_key`."""

    optimizer_key: ClassVar[str] = "optimizer"
    # Whether the members of a round hold the same `_replica_tensors()` bit for bit after it
    # (allreduce, DiLoCo's outer parameters, sketch-dp), or each its own (gossip).
    replicas_agree: ClassVar[bool] = False
    guard: DriftGuard | None = None  # set by a protocol whose replicas agree (`_drift_guard`)

    def __init__(self, node: Node, model: nn.Module, config: ProtocolConfig) -> None:
        super().__init__(node, model, config)
        self.flat = FlatModel(model)
        self.optimizer = self._make_optimizer()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer named by the config's `optimizer`, `lr`, `momentum` and `weight_decay`."""
        c: Any = self.config
        return make_optimizer(self.flat.params, c.optimizer, c.lr, c.momentum, c.weight_decay)

    def _backprop(self, loss_fn: LossFn) -> float:
        """Gradients of `loss_fn()` at the current parameters, in place of the last step's; returns
        the loss. They are zeroed in place, not set to None: the buffers are reused, and a parameter
        this loss does not reach keeps a zero gradient (once it has had one), which the optimizer
        still steps (momentum, weight decay) like any other."""
        self.optimizer.zero_grad(set_to_none=False)
        loss = loss_fn()
        loss.backward()
        return float(loss.detach())

    # ------------------------------------------------------------------ the drift guard
    def _drift_guard(self, prefix: str, what: str = "parameters") -> DriftGuard | None:
        """The guard of a protocol whose peers hold the same `_replica_tensors()` (its logs call
        them `what`), every `check_every` rounds of its config (None when 0); its small round
        gets peer events."""
        c: Any = self.config
        if not c.check_every:
            return None
        guard = DriftGuard(self.node, prefix, c.check_every, reduce_timeouts(c), self.is_open, self._replica_tensors,
                           self._replica_state, self._take_replica_state, self._replica_tensors_of, what=what)
        self.side_reducers.append(guard.reducer)
        return guard

    def synced_digest(self) -> str | None:
        """A short digest of the state every member holds bit for bit after a round (what the
        drift guard compares), for checking from outside that the members agree; None where
        each peer holds its own. Hashes that state once (every parameter, on the host)."""
        if not self.replicas_agree:
            return None
        return digest_bytes(self._replica_tensors(), 8).hex()

    def _round_state(self, t: int | None = None) -> bytes | None:
        """The digest my parts of a round name of the state I begin it with (the guard's, with
        the runtime's `round_context`); None without a guard. `t`: the round, where nothing
        changes the state between its start and the guard's check after it (`DriftGuard.round_digest`)."""
        if self.guard is None:
            return None
        return self.guard.round_digest(self.round_context() if self.round_context is not None else b"", t)

    def _replica_tensors(self) -> Sequence[torch.Tensor]:
        """What the guard compares: the parameters."""
        return self.flat.params

    def _replica_tensors_of(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        """What `_replica_tensors()` would be after taking this state: its parameters, each in
        its parameter's shape and dtype (as `write_params` rounds them)."""
        chunks = torch.split(self._replica_params(tensors), self.flat.sizes)
        return [chunk.view_as(p).to(p.dtype) for p, chunk in zip(self.flat.params, chunks)]

    def _replica_params(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The flat parameters a state sent by `_replica_state` starts with (ValueError if not)."""
        params = tensors[0] if tensors else None
        if not (isinstance(params, torch.Tensor) and params.dtype == torch.float32
                and params.numel() == self.flat.numel and bool(torch.isfinite(params).all())):
            raise ValueError(f"expected {self.flat.numel} finite float32 parameters first")
        return params.reshape(-1)

    def _replica_state(self) -> State:
        """What a drifted peer takes from a member holding the majority's parameters: parameters
        and optimizer state, a copy in host memory (kept until the next check, it spares an
        accelerator's)."""
        header, tensors = optimizer_to_wire(self.optimizer)
        return {"optimizer": header}, [self.flat.read_params().cpu(), *tensors]

    def _take_replica_state(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        params = self._replica_params(tensors)
        optimizer_from_wire(self.optimizer, header.get("optimizer") or {}, tensors[1:])
        self.flat.write_params(params)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state[self.optimizer_key] = optimizer_state(self.optimizer)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if self.optimizer_key in state:  # a state saved without it keeps this peer's optimizer
            self.optimizer.load_state_dict(state[self.optimizer_key])
