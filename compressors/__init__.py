"""starling.compressors: tensor codecs, error feedback and the shared counter RNG.

    c = from_spec("topk:0.01+int8")
    packet = c.encode(tensor, seed=None, name=None)   # Packet(header, buffers)
    tensor = c.decode(packet, device=None)            # original shape and dtype

Codecs (see ``registered_codecs()``): none, fp16, bf16, fp8, int8, int4, fp4, sign,
topk, randomk, powersgd, countsketch, gsketch; compose with ``+``.
"""
from __future__ import annotations

from . import rng
from .base import Compressor, NonFiniteError, Packet, PacketError, decode
from .cast import BFloat16, Float16, Raw
from .feedback import ErrorFeedback
from .lowrank import PowerSGD
from .quant import FP4, FP8, Int4, Int8, Sign
from .registry import from_spec, registered_codecs
from .sketch import CountSketch, GaussianSketch
from .sparse import RandomK, TopK

__all__ = [
    "Compressor",
    "Packet",
    "PacketError",
    "NonFiniteError",
    "ErrorFeedback",
    "from_spec",
    "registered_codecs",
    "decode",
    "rng",
    "Raw",
    "Float16",
    "BFloat16",
    "Int8",
    "Int4",
    "FP4",
    "FP8",
    "Sign",
    "TopK",
    "RandomK",
    "PowerSGD",
    "CountSketch",
    "GaussianSketch",
]
