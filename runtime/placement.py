"""Where one peer trains and in what precision: its own choice, not the swarm's.

    placement = Placement.parse(device="auto", dtype="bf16", autocast="none", state_device="cpu")
    model = placement.place(task.make_model())          # on the device, in the dtype
    with placement.autocast(model):                     # around the loss only
        loss = task.loss(model, placement.batch(batch, model))

A swarm may mix peers on GPUs with peers on CPUs, and bfloat16 peers with float32 ones: what
peers exchange (pseudo-gradients, averages, outer parameters) is float32 on every peer, and
a joiner's state is cast to its own dtype and moved to its own device when it loads.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from starling.common.devices import resolve_autocast, resolve_device, resolve_dtype, to_model_device


@dataclass(frozen=True)
class Placement:
    """None everywhere: the model stays as the task built it (the built-in tasks: CPU, float32)."""

    device: torch.device | None = None  # where the model and its batches go
    dtype: torch.dtype | None = None  # the model's floating parameters and buffers
    autocast_dtype: torch.dtype | None = None  # compute the loss under autocast in this dtype
    state_device: torch.device | None = None  # the protocol's outer state (None: the model's device)

    @classmethod
    def parse(cls, device: str | None = None, dtype: str | None = None, autocast: str | None = None,
              state_device: str | None = None) -> Placement:
        """From CLI text (None: as the task built it); raises DeviceError (a ValueError) naming
        what this machine lacks."""
        return cls(None if device is None else resolve_device(device),
                   None if dtype is None else resolve_dtype(dtype), resolve_autocast(autocast),
                   None if state_device in (None, "", "model") else resolve_device(state_device))

    @property
    def on_accelerator(self) -> bool:
        return self.device is not None and self.device.type != "cpu"

    def place(self, model: nn.Module) -> nn.Module:
        """The model on the device, its floating tensors in the dtype (integer buffers stay)."""
        to: dict[str, Any] = {}
        if self.device is not None:
            to["device"] = self.device
        if self.dtype is not None:
            to["dtype"] = self.dtype
        return model.to(**to) if to else model

    def lowers_precision(self, model: nn.Module) -> bool:
        """Whether `place` casts some floating parameter to another dtype (and so may round it)."""
        return self.dtype is not None and any(p.is_floating_point() and p.dtype != self.dtype
                                              for p in model.parameters())

    @staticmethod
    def batch(batch: Any, model: nn.Module) -> Any:
        """`batch` on the device of the model's first parameter."""
        return to_model_device(batch, model)

    @contextlib.contextmanager
    def autocast(self, model: nn.Module) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        first = next(model.parameters(), None)
        device_type = first.device.type if first is not None else "cpu"
        with torch.autocast(device_type=device_type, dtype=self.autocast_dtype):
            yield

    def describe(self) -> dict[str, Any]:
        def name(x: object) -> str:
            return "as built" if x is None else str(x).removeprefix("torch.")

        return {"device": name(self.device), "dtype": name(self.dtype),
                "autocast": "none" if self.autocast_dtype is None else name(self.autocast_dtype),
                "state_device": "model" if self.state_device is None else str(self.state_device)}
