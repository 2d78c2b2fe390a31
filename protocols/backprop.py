"""What the backprop protocols (allreduce, gossip, DiLoCo, sketch-dp) share: the model's
trainable parameters as one flat float32 vector, a torch optimizer over them, and the backward
pass that begins each local step."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from starling.collectives import FlatModel
from starling.protocols.base import LossFn, Protocol, ProtocolConfig
from starling.protocols.optim import make_optimizer, optimizer_state

if TYPE_CHECKING:
    from starling.node.node import Node


class BackpropProtocol(Protocol):
    """A protocol whose local step is backprop and a torch optimizer step over `flat.params`.
    Its `state_dict` holds the optimizer's state too, under `optimizer_key`."""

    optimizer_key: ClassVar[str] = "optimizer"

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

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state[self.optimizer_key] = optimizer_state(self.optimizer)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if self.optimizer_key in state:  # a state saved without it keeps this peer's optimizer
            self.optimizer.load_state_dict(state[self.optimizer_key])
