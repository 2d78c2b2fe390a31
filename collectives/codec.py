"""Compressors as the collectives use them: a codec with error feedback where it is lossy,
packets rebuilt from wire frames, and their values read in place."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from starling.compressors import Compressor, ErrorFeedback, Packet, decode, from_spec


def make_codec(spec: str, decay: float = 1.0) -> tuple[Compressor, ErrorFeedback | None]:
    """The compressor for `spec`, and error feedback unless it is lossless (nothing to feed back);
    `decay` < 1 makes the feedback forget its residual at that rate (compressors/feedback.py)."""
    codec = from_spec(spec)
    return codec, (None if codec.lossless else ErrorFeedback(codec, decay))


def check_compressor_spec(spec: str) -> None:
    """For config `__post_init__`: raises ValueError naming a bad spec."""
    from_spec(spec)


def encode(codec: Compressor, feedback: ErrorFeedback | None, tensor: torch.Tensor, name: str) -> Packet:
    """Encode with error feedback when there is any; a residual whose shape no longer
    matches (membership changed the shard sizes) is dropped first."""
    if feedback is None:
        return codec.encode(tensor, name=name)
    residual = feedback.residual(name)
    if residual is not None and residual.shape != tensor.shape:
        feedback.reset(name)
    return feedback.encode(tensor, name=name)


def packet_from_wire(header: Any, payload: Sequence[Any]) -> Packet:
    """Rebuild a packet from a message: buffers travel as uint8 tensor frames."""
    if not isinstance(header, dict):
        raise ValueError("packet header must be a map")
    buffers = []
    for item in payload:
        if isinstance(item, torch.Tensor):
            buffers.append(item.reshape(-1).view(torch.uint8))
        else:
            buffers.append(torch.frombuffer(bytearray(item), dtype=torch.uint8))
    return Packet(header, tuple(buffers))


def decode_flat(packet: Packet) -> torch.Tensor:
    """The packet's values as a 1-D tensor, by the codec its header names. A zero-copy codec's
    packet is read in place, as a view of its wire buffer: a copy would be wasted, since every
    value is read once (added to a sum, or copied into the caller's vector) and never written."""
    return decode(packet, copy=False).reshape(-1)


def shares_memory(part: torch.Tensor, packet: Packet) -> bool:
    """Whether a decoded part is a view of the wire buffers it came from."""
    storage = part.untyped_storage().data_ptr()
    return any(b.untyped_storage().data_ptr() == storage for b in packet.buffers)
