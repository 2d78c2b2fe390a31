"""starling.collectives: what protocols are written against.

The sharded all-reduce (`ShardedReducer`: round engine, shard layout, accumulator), the flat
view of a model's parameters, codecs with error feedback, the per-step byte meter, patient
requests and peer events. Nothing here knows a specific protocol.
"""
from __future__ import annotations

from starling.collectives.agreement import AgreementCheck
from starling.collectives.buffers import BufferAverager
from starling.collectives.codec import encode, make_codec, packet_from_wire
from starling.collectives.events import GONE, membership, watch_peers
from starling.collectives.flat import FlatModel
from starling.collectives.layout import DEFAULT_CHUNK_NUMEL, chunk_layout, shard_bounds
from starling.collectives.meter import ByteMeter
from starling.collectives.reduce import PendingReduce, ReduceResult, ReduceTimeouts, ShardedReducer
from starling.collectives.requests import request_patiently

__all__ = [
    "DEFAULT_CHUNK_NUMEL", "GONE", "AgreementCheck", "BufferAverager", "ByteMeter", "FlatModel", "PendingReduce",
    "ReduceResult", "ReduceTimeouts", "ShardedReducer", "chunk_layout", "encode", "make_codec", "membership",
    "packet_from_wire", "request_patiently", "shard_bounds", "watch_peers",
]
