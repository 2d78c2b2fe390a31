"""Bit packing on uint8 tensors, vectorized and device-agnostic.

Bit order everywhere: element ``i`` goes to bit ``i % 8`` (least significant first) of byte
``i // 8``. Little-endian byte order is assumed for multi-byte views (true for every device
torch runs on).
"""
from __future__ import annotations

import torch

# Multiplying a word whose eight bytes are each 0 or 1 by this constant gathers the eight
# low bits into the top byte (byte i -> bit i); the partial products never collide.
_GATHER = 0x0102040810204080
# Spreading a byte into eight bytes: replicate it, keep bit i in byte i.
_REPLICATE = 0x0101010101010101
_SELECT = 0x8040201008040201 - (1 << 64)  # as signed int64


def pack_bits_into(bits: torch.Tensor, out: torch.Tensor) -> None:
    """Pack a contiguous bool/uint8 tensor of 0/1 (length a multiple of 8) into ``out``."""
    words = bits.view(torch.uint8).view(torch.int64)
    gathered = words.mul(_GATHER).bitwise_right_shift_(56).bitwise_and_(0xFF)
    out.copy_(gathered)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack 0/1 values (bool or uint8, any length) into ceil(len / 8) bytes."""
    bits = bits.reshape(-1)
    n = bits.numel()
    if n % 8 or (bits.numel() and bits.data_ptr() % 8) or not bits.is_contiguous():
        padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=bits.device)
        padded[:n] = bits
        bits = padded
    out = torch.empty(bits.numel() // 8, dtype=torch.uint8, device=bits.device)
    if out.numel():
        pack_bits_into(bits, out)
    return out


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bits of ``packed`` as a bool tensor (never writes to ``packed``)."""
    words = packed.to(torch.int64).mul_(_REPLICATE).bitwise_and_(_SELECT)
    return words.view(torch.uint8).view(-1)[:n] != 0


def _chunk(device: torch.device, chunk: int | None) -> int:
    """Values per pass of the general packing loop: cache-sized on the CPU, large elsewhere
    (on an accelerator every op is a kernel launch, and a 64K chunk made thousands)."""
    if chunk is not None:
        return chunk
    return 1 << 16 if device.type == "cpu" else 1 << 22


def pack_uints(values: torch.Tensor, width: int, chunk: int | None = None) -> torch.Tensor:
    """Pack non-negative int64 ``values`` (each < 2**width) with ``width`` bits each."""
    k = values.numel()
    out = torch.empty((k * width + 7) // 8, dtype=torch.uint8, device=values.device)
    if k == 0:
        return out
    if 8 % width == 0:  # 1, 2, 4 or 8 bits: whole values per byte, a few passes over the tensor
        per = 8 // width
        small = values.reshape(-1).to(torch.uint8)
        if k % per:
            small = torch.cat((small, small.new_zeros(per - k % per)))
        columns = small.view(-1, per)
        torch.bitwise_left_shift(columns[:, per - 1], width * (per - 1), out=out)
        for j in range(per - 2, -1, -1):
            out.bitwise_or_(columns[:, j].bitwise_left_shift(width * j) if j else columns[:, 0])
        return out
    shifts = torch.arange(width, dtype=torch.int64, device=values.device)
    step = _chunk(values.device, chunk) // 8 * 8  # whole bytes per chunk
    for lo in range(0, k, step):
        part = values[lo : lo + step]
        bits = part.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).to(torch.uint8).view(-1)
        packed = pack_bits(bits)
        first = lo * width // 8
        out[first : first + packed.numel()] = packed
    return out


def unpack_uints(packed: torch.Tensor, k: int, width: int, chunk: int | None = None) -> torch.Tensor:
    """Inverse of ``pack_uints``: ``k`` int64 values of ``width`` bits."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=packed.device)
    if 8 % width == 0:
        per, mask = 8 // width, (1 << width) - 1
        nbytes = (k * width + 7) // 8
        source = packed[:nbytes]
        columns = torch.empty(nbytes, per, dtype=torch.uint8, device=packed.device)
        for j in range(per):
            torch.bitwise_right_shift(source, width * j, out=columns[:, j])
            columns[:, j].bitwise_and_(mask)
        return columns.view(-1)[:k].to(torch.int64)
    out = torch.empty(k, dtype=torch.int64, device=packed.device)
    shifts = torch.arange(width, dtype=torch.int64, device=packed.device)
    step = _chunk(packed.device, chunk) // 8 * 8
    for lo in range(0, k, step):
        count = min(step, k - lo)
        first = lo * width // 8
        nbytes = (count * width + 7) // 8
        bits = unpack_bits(packed[first : first + nbytes], count * width).view(count, width)
        out[lo : lo + count] = bits.to(torch.int64).bitwise_left_shift_(shifts).sum(dim=1)
    return out
