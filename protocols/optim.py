"""What the optimizer-driven protocols share: their config checks, round timeouts and the optimizer."""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from starling.collectives import ReduceTimeouts
from starling.collectives.codec import check_compressor_spec
from starling.collectives.defences import Defences
from starling.collectives.secure import SecureAggregation, check_secure_config
from starling.protocols.base import ProtocolError


def check_reduce_config(config: Any, optimizer: str = "optimizer", momentum: str = "momentum") -> None:
    """For `__post_init__` of configs that train with an optimizer over a ShardedReducer
    (allreduce, sketch-dp, DiLoCo, whose optimizer fields are `inner_optimizer` and
    `inner_momentum`): the optimizer, the round timeouts and the compressor; raises
    ValueError naming the bad field."""
    check_optimizer(config, optimizer, momentum)
    check_round_timeouts(config)
    if config.max_owners < 0:
        raise ValueError(f"max_owners must be >= 0 (0: every member owns a shard), got {config.max_owners}")
    if config.min_shard_numel < 1:
        raise ValueError(f"min_shard_numel must be >= 1, got {config.min_shard_numel}")
    check_compressor_spec(config.compressor)
    make_defences(config)
    check_secure_config(config)


def make_secure(config: Any, unit: float = 1.0) -> SecureAggregation | None:
    """The secure aggregation a config asks for (None: off), its parts' weights scaled against
    `unit` (the weight a part usually carries: 1 for a gradient, a round's inner steps for a
    pseudo-gradient)."""
    secure = SecureAggregation.parse(config.secure_aggregation)
    return None if secure is None else replace(secure, unit=unit)


def make_defences(config: Any, max_weight: float | None = None) -> Defences:
    """The defences a config's `aggregator`, `owner_replication` and `check_rate` ask for.
    `max_weight` (the most weight a part can honestly claim, from the round's step budget) caps
    parts only with a defence on: a swarm that asked for none is not one that bans a peer over
    its weights."""
    defences = Defences(config.aggregator, config.owner_replication, check_rate=config.check_rate)
    if max_weight is None or not defences.on:
        return defences
    return replace(defences, max_weight=max_weight)


def check_optimizer(config: Any, optimizer: str, momentum: str) -> None:
    """The optimizer fields of a config (`lr`, `weight_decay`, and the optimizer and momentum
    under the config's own names): raises ValueError naming the bad field."""
    if getattr(config, optimizer) not in ("sgd", "adamw"):
        raise ValueError(f"{optimizer} must be 'sgd' or 'adamw', got {getattr(config, optimizer)!r}")
    if not config.lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {config.lr}")
    if not 0.0 <= getattr(config, momentum) < 1.0:
        raise ValueError(f"{momentum} must be in [0, 1), got {getattr(config, momentum)}")
    if config.weight_decay < 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {config.weight_decay}")


def check_round_timeouts(config: Any) -> None:
    """A config's round timeouts (see `reduce_timeouts`) must be > 0."""
    for name in ("round_timeout_s", "reply_grace_s", "retry_interval_s"):
        if not getattr(config, name) > 0.0:
            raise ValueError(f"{name} must be > 0, got {getattr(config, name)}")


def reduce_timeouts(config: Any) -> ReduceTimeouts:
    """A config's round timeouts (the fields `check_reduce_config` checks) for its reducers."""
    return ReduceTimeouts(config.round_timeout_s, config.reply_grace_s, config.retry_interval_s)


def make_optimizer(params: Sequence[nn.Parameter], name: str, lr: float, momentum: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ProtocolError(f"unknown optimizer {name!r}; known: sgd, adamw")


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


def optimizer_to_wire(opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The optimizer's per-parameter state (momentum, Adam's moments and step) as a header and
    tensors to send; its param_groups (lr and the like) are the swarm's config and stay."""
    entries: list[list[Any]] = []
    tensors: list[torch.Tensor] = []
    for index, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                entries.append([int(index), str(name), "tensor", len(tensors)])
                tensors.append(value.detach().cpu().clone())
            else:
                entries.append([int(index), str(name), "value", value])
    return {"entries": entries}, tensors


def optimizer_from_wire(opt: torch.optim.Optimizer, header: dict[str, Any], tensors: Sequence[torch.Tensor]) -> None:
    """Load what `optimizer_to_wire` made on a peer with the same parameters; ValueError (and no
    change) when it does not fit them."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for entry in header.get("entries", ()):
        index, name, kind, value = entry
        if not (isinstance(index, int) and 0 <= index < len(params)):
            raise ValueError(f"optimizer state for parameter {index!r}; this model has {len(params)}")
        if kind == "tensor":
            if not (isinstance(value, int) and 0 <= value < len(tensors)):
                raise ValueError(f"optimizer state {name!r} names frame {value!r} of {len(tensors)}")
            tensor = tensors[value]
            if tensor.dim() and tensor.shape != params[index].shape:
                raise ValueError(f"optimizer state {name!r} of shape {tuple(tensor.shape)} for a parameter of "
                                 f"shape {tuple(params[index].shape)}")
            value = tensor.clone()
        state.setdefault(index, {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
