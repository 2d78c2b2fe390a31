"""``powersgd:RANK``: rank-r approximation by one warm-started power iteration.

For a matrix M (the tensor viewed as ``shape[0]`` rows), with Q the previous call's right
factor for the same ``name`` (or a seeded Gaussian the first time):

    P = orthonormalize(M Q)        # reduced QR
    Q = M^T P                      # kept for the next call: the warm start
    send P and Q;  decode M ~ P Q^T

Only worth it where (rows + cols) * rank < rows * cols; other tensors (vectors, small or
skinny matrices) go whole to the next stage, so ``powersgd:4+int8`` sends biases as int8
and ``powersgd:4`` sends them raw. The factors travel as one float32 payload (float64 for
float64 input) for the next stage.

PowerSGD is biased: use it under ``ErrorFeedback``. Non-finite input raises
``NonFiniteError`` before any warm-start state changes.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from . import rng
from .base import Compressor, Encoded, Header, NonFiniteError, PacketError, Param
from .registry import register


def _parse_rank(text: str) -> int:
    rank = int(text)
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    return rank


@register
class PowerSGD(Compressor):
    codec = "powersgd"
    stage_lossless = stage_zero_copy = False
    takes_inner = True
    params = (Param("rank", _parse_rank, 4, positional=True, required=True),)

    def __init__(self, rank: int = 4, inner: Compressor | None = None) -> None:
        super().__init__(inner)
        self.rank = _parse_rank(str(rank))
        self._q: dict[str, torch.Tensor] = {}

    @staticmethod
    def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
        if len(shape) < 2 or shape[0] == 0:
            return None
        return shape[0], math.prod(shape[1:])

    def _encode(self, flat, shape, seed, name) -> Encoded:
        dims = self.matrix_shape(shape)
        rank = min(self.rank, *dims) if dims else 0
        if dims is None or (dims[0] + dims[1]) * rank >= dims[0] * dims[1]:
            return Encoded({"mode": "full"}, (), flat)
        rows, cols = dims
        work = torch.float64 if flat.dtype == torch.float64 else torch.float32
        m = flat.view(rows, cols).to(work)
        q = self._q.get(name) if name is not None else None
        if q is None or q.shape != (cols, rank) or q.device != m.device or q.dtype != work:
            init_seed = rng.derive_seed(0 if seed is None else seed, cols, rank)
            q = rng.normal(init_seed, cols * rank, m.device, work).view(cols, rank)
        p = torch.linalg.qr(m @ q, mode="reduced").Q
        q = m.T @ p
        if not (bool(torch.isfinite(p).all()) and bool(torch.isfinite(q).all())):
            raise NonFiniteError("powersgd: input holds NaN or Inf")
        if name is not None:
            self._q[name] = q.clone()
        payload = torch.cat((p.reshape(-1), q.reshape(-1)))
        return Encoded({"mode": "lowrank", "rows": rows, "cols": cols, "rank": rank}, (), payload)

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        n = math.prod(shape)
        mode = h.str("mode", ("full", "lowrank"))
        if mode == "full":
            if payload.numel() != n:
                raise PacketError(h.path + "inner.shape", f"{payload.numel()} values for {n}")
            return payload.to(device=device, dtype=dtype)
        rows, cols = h.int("rows", 1), h.int("cols", 1)
        rank = h.int("rank", 1, min(rows, cols))
        if rows * cols != n:
            raise h.error("rows", f"rows * cols = {rows * cols}, shape has {n} values")
        if payload.numel() != (rows + cols) * rank:
            raise PacketError(h.path + "inner.shape", f"{payload.numel()} values for rank-{rank} factors")
        work = torch.float64 if payload.dtype == torch.float64 else torch.float32
        factors = payload.to(device=device, dtype=work)
        p = factors[: rows * rank].view(rows, rank)
        q = factors[rows * rank :].view(cols, rank)
        return (p @ q.T).to(dtype).reshape(-1)

    def reset(self) -> None:
        self._q.clear()
        super().reset()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["q"] = {k: v.clone() for k, v in self._q.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        q = state.get("q", {})
        if not isinstance(q, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() == 2
                                              for k, v in q.items()):
            raise ValueError("powersgd state 'q' must map names to 2-D tensors")
        super().load_state_dict(state)
        self._q = {k: v.clone() for k, v in q.items()}
