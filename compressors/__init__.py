"""starling.compressors: tensor codecs, error feedback and the shared counter RNG.

    c = from_spec("topk:0.01+int8")
    packet = c.encode(tensor, seed=None, name=None)   # Packet(header, buffers)
    tensor = c.decode(packet, device=None)            # original shape and dtype
    decode(packet)                                    # by the codec its header names
    c.lossless, c.zero_copy                           # what it can do; branch on these, not on names
    c.encode(t, copy=False), decode(p, copy=False)    # zero_copy: lend t / read the wire buffer in place

Codecs (``registered_codecs()``; same torch code on CPU and CUDA; any float dtype in, the
input dtype back). "NaN/Inf" says what encoding a non-finite tensor does.

    spec                         wire per value            NaN/Inf
    none / fp16 / bf16           4 / 2 / 2 bytes           passed through (IEEE casts); none: lossless, zero-copy
    fp8[:e4m3|e5m2]              1 byte + scale/block      NonFiniteError
    int8, int4                   8 / 4 bits + scale/block  NonFiniteError
    fp4[:e2m1|e3m0]              4 bits + scale/block      NonFiniteError
    sign                         1 bit + scale/block       NonFiniteError
    topk:F                       F * (value + index)       NonFiniteError
    chunktopk:K/C                K/C * (value + log2 C)    NonFiniteError
    q2[:block=B]                 2 bits + 2 scales/block   NonFiniteError
    randomk:F                    F * value (seeded)        raises if a sent value is
    powersgd:R                   (rows + cols) * R         NonFiniteError (vectors: next stage)
    countsketch:RxC[,heavy=K]    R * C (seeded)            NonFiniteError
    gsketch:S[,kind=gauss|srht]  S (seeded)                NonFiniteError

Block quantizers take ``block=`` and (int8, int4, fp4) ``stochastic=true``. Stages
compose with ``+``: a sparsifier, PowerSGD or a sketch hands its values to the next stage.
"""
from __future__ import annotations

from . import rng
from .base import Compressor, NonFiniteError, Packet, PacketError, decode
from .cast import BFloat16, Float16, Raw
from .chunked import Q2, ChunkTopK
from .feedback import ErrorFeedback
from .lowrank import PowerSGD
from .quant import FP4, FP8, Int4, Int8, Sign
from .registry import from_spec, registered_codecs
from .sketch import CountSketch, GaussianSketch
from .sparse import RandomK, TopK

__all__ = [
    "FP4",
    "FP8",
    "Q2",
    "BFloat16",
    "ChunkTopK",
    "Compressor",
    "CountSketch",
    "ErrorFeedback",
    "Float16",
    "GaussianSketch",
    "Int4",
    "Int8",
    "NonFiniteError",
    "Packet",
    "PacketError",
    "PowerSGD",
    "RandomK",
    "Raw",
    "Sign",
    "TopK",
    "decode",
    "from_spec",
    "registered_codecs",
    "rng",
]
