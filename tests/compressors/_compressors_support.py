"""Shared constants and helpers for the compressor tests (imported by name; no conftest)."""
from __future__ import annotations

import warnings

import msgpack
import pytest
import torch

from starling.compressors import Packet

# Every spec the suite round-trips; small enough parameters for small test tensors.
ALL_SPECS = [
    "none",
    "fp16",
    "bf16",
    "fp8",
    "fp8:e5m2",
    "int8",
    "int8:block=8,stochastic=true",
    "int4",
    "int4:block=16,stochastic=true",
    "fp4",
    "fp4:e3m0",
    "fp4:block=16,stochastic=true",
    "fp4:e3m0,stochastic=true",
    "sign",
    "sign:block=8",
    "topk:0.1",
    "topk:0.5",
    "topk:0.3+int8",
    "topk:0.2+fp4:e3m0",
    "randomk:0.25",
    "randomk:0.5+int4",
    "powersgd:2",
    "powersgd:1+int8",
    "countsketch:3x16",
    "countsketch:5x32,heavy=3+fp16",
    "gsketch:16",
    "gsketch:32,kind=srht",
    "gsketch:8,kind=srht+int8",
]

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def over_the_wire(packet: Packet) -> Packet:
    """What the network layer does: msgpack the header, send buffers as raw frames, and
    rebuild with torch.frombuffer over read-only bytes."""
    header = msgpack.unpackb(msgpack.packb(packet.header, use_bin_type=True), raw=False)
    frames = [bytes(b.cpu().numpy().tobytes()) for b in packet.buffers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": that is the point
        buffers = tuple(
            torch.frombuffer(f, dtype=torch.uint8) if f else torch.empty(0, dtype=torch.uint8) for f in frames
        )
    return Packet(header, buffers)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
