"""What a swarm's model is made of: the name, shape and dtype of every tensor of its state
(parameters and buffers), carried in the swarm config so that a joiner whose model differs is
refused before it fetches anything, with the first tensor that differs named.

    architecture(model)            ["h.0.attn.weight:64x64:float32", ...] in state_dict order
    first_difference(swarm, mine)  "tensor 'h.0.attn.weight': the swarm's is 64x64 float32,
                                    this peer's is 64x128 float32", or None
    state_digest(model)            a SHA-256 (hex, 16 digits) of every tensor's values, in order

The digest of the first peer's initial state rides in the swarm config too (INITIAL_STATE_KEY):
a peer whose model starts elsewhere (every process seeding its own model, say) learns at once
that it must take the swarm's state instead of training from its own start.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from starling.common.hashing import tensor_digest

ARCHITECTURE_KEY = "architecture"  # the swarm config's entry
INITIAL_STATE_KEY = "initial_state"  # the swarm config's digest of the first peer's initial state
MAX_TENSORS = 100_000  # what a peer reads of another's list: remote input stays bounded


def architecture(model: nn.Module) -> list[str]:
    """One "name:shape:dtype" string per tensor of the model's state (a scalar's shape is "")."""
    return [f"{name}:{'x'.join(map(str, t.shape))}:{str(t.dtype).removeprefix('torch.')}"
            for name, t in model.state_dict().items()]


def _split(entry: object) -> tuple[str, str]:
    """(name, "shape dtype") of one entry; a malformed one reads as a name that matches nothing."""
    if not isinstance(entry, str) or entry.count(":") < 2:
        return f"<malformed entry {entry!r:.60}>", ""
    name, shape, dtype = entry.rsplit(":", 2)
    return name, f"{shape or 'scalar'} {dtype}"


def first_difference(swarm: Sequence[object], mine: Sequence[str]) -> str | None:
    """The first tensor, in the swarm's order, that this peer's model lacks or holds with
    another shape or dtype, or the first one this peer has that the swarm's lacks; None when
    the two agree."""
    theirs = dict(_split(e) for e in list(swarm)[:MAX_TENSORS])
    ours = dict(_split(e) for e in mine)
    for name, spec in theirs.items():
        if name not in ours:
            return f"tensor {name!r} ({spec}) of the swarm's model is missing from this peer's"
        if ours[name] != spec:
            return f"tensor {name!r}: the swarm's is {spec}, this peer's is {ours[name]}"
    for name, spec in ours.items():
        if name not in theirs:
            return f"tensor {name!r} ({spec}) of this peer's model is not in the swarm's"
    return None


@torch.no_grad()
def state_digest(model: nn.Module) -> str:
    """A digest of the values of every tensor of the model's state, in state_dict order (names,
    shapes and dtypes are the architecture's business). Tensors are read on the host, one at a
    time."""
    state = model.state_dict()
    return tensor_digest(state.values(), state.keys()).hexdigest()[:16]
