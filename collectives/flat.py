"""The model's trainable parameters as one flat float32 vector, and their gradients.

The vector lives on the parameters' device (a model on a GPU is read, averaged and written
there), and is float32 whatever the parameters' dtype: a bfloat16 or float16 model is read
into float32, and what is written back is rounded to the parameter's dtype."""
from __future__ import annotations

import torch
from torch import nn


class FlatModel:
    """The model's trainable parameters seen as one float32 vector (and their gradients).

    The flat buffers are allocated once; copying in and out is the only per-step cost.
    """

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"the model's trainable parameters are spread over {sorted(map(str, devices))}; "
                             "one peer's model must sit on one device (see replica groups for more)")
        self.device = self.params[0].device
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        # made at the first gather_grads: a protocol that never gathers them (DiLoCo's inner
        # steps) would otherwise hold a float32 copy of the model for nothing
        self._grad: torch.Tensor | None = None

    @property
    def grad(self) -> torch.Tensor:
        """The persistent flat gradient buffer (float32, on the parameters' device)."""
        if self._grad is None:
            self._grad = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        return self._grad

    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, self.sizes))

    def gather_grads(self) -> torch.Tensor:
        """Copy every gradient into the persistent flat buffer (zeros for unused params)."""
        for p, chunk in zip(self.params, self._chunks(self.grad)):
            if p.grad is None:
                chunk.zero_()
            else:
                chunk.copy_(p.grad.reshape(-1))
        return self.grad

    def scatter_grads(self, flat: torch.Tensor) -> None:
        for p, chunk in zip(self.params, self._chunks(flat)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(chunk.view_as(p.grad))

    @torch.no_grad()
    def read_params(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=torch.float32, device=self.device) if out is None else out
        for p, chunk in zip(self.params, self._chunks(out)):
            chunk.copy_(p.reshape(-1))
        return out

    @torch.no_grad()
    def add_to_params(self, delta: torch.Tensor) -> None:
        for p, chunk in zip(self.params, self._chunks(delta)):
            p.add_(chunk.view_as(p).to(p.dtype))

    @torch.no_grad()
    def write_params(self, flat: torch.Tensor) -> None:
        for p, chunk in zip(self.params, self._chunks(flat)):
            p.copy_(chunk.view_as(p))
