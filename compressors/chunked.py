"""Chunked top-k (``chunktopk:K/C``) and two-bit sign-magnitude values (``q2``): the
pseudo-gradient codec of SparseLoCo (Sarfi et al. 2025), ``chunktopk:64/4096+q2``.

``chunktopk:K/C`` cuts the flat tensor into chunks of C consecutive values (the last one may
be shorter) and keeps the K largest magnitudes of each (all of a last chunk shorter than K).
Each kept value's index within its chunk travels in ``ceil(log2 C)`` bits (12 for C = 4096),
chunk after chunk, increasing within a chunk; the kept values go to the next stage in the
same order, so that a block quantizer with ``block=K`` (``q2`` by default: its block is 64)
gives every chunk a scale of its own. Without a next stage the values travel raw.

``q2``: each value in 2 bits, a sign and one of two magnitudes, per block of ``block`` values
the block's smallest and largest magnitude (two float32): a top-k chunk's values all lie in
a narrow band of magnitudes, which the two levels span. For 1 bit per value use ``sign``
(one mean magnitude per block), for 4 bits ``int4``.

Bits per parameter of ``chunktopk:K/C+q2:block=K``: K/C * (ceil(log2 C) + 2) + 64/C, so
0.227 for ``64/4096``.

Decoding refuses (``PacketError``, naming the field) indices out of their chunk, indices not
increasing within a chunk (a repeated one included), buffers whose length does not match the
counts the header implies, and NaN, Inf or negative scales.
"""
from __future__ import annotations

import math

import torch

from .base import Compressor, Encoded, Header, NonFiniteError, PacketError, Param, as_bytes, view_as
from .packing import pack_uints, unpack_uints
from .registry import register
from .sparse import index_width

_MAX_CHUNK = 1 << 24


def _parse_chunking(text: str) -> tuple[int, int]:
    k_text, slash, c_text = text.partition("/")
    if not slash:
        raise ValueError(f"expected K/C (values kept per chunk / chunk length), got {text!r}")
    k, chunk = int(k_text), int(c_text)
    if not 2 <= chunk <= _MAX_CHUNK or not 1 <= k <= chunk:
        raise ValueError(f"need 1 <= K <= C and 2 <= C <= 2**24, got K={k}, C={chunk}")
    return k, chunk


def _fmt_chunking(value: tuple[int, int]) -> str:
    return f"{value[0]}/{value[1]}"


def chunk_counts(n: int, k: int, chunk: int) -> tuple[int, int, int]:
    """(full chunks, length of a last shorter chunk or 0, values kept in it)."""
    full, tail = divmod(n, chunk)
    return full, tail, min(k, tail)


@register
class ChunkTopK(Compressor):
    """Keep the K largest magnitudes of every chunk of C values."""

    codec = "chunktopk"
    stage_lossless = stage_zero_copy = False
    n_buffers = 1
    takes_inner = True
    params = (Param("chunking", _parse_chunking, (64, 4096), positional=True, fmt=_fmt_chunking, required=True),)

    def __init__(self, chunking: tuple[int, int] = (64, 4096), inner: Compressor | None = None) -> None:
        super().__init__(inner)
        self.chunking = _parse_chunking(_fmt_chunking(chunking))

    def _encode(self, flat, shape, seed, name) -> Encoded:
        k, chunk = self.chunking
        n = flat.numel()
        full, tail, k_tail = chunk_counts(n, k, chunk)
        parts: list[torch.Tensor] = []
        if full:
            rows = flat[: full * chunk].view(full, chunk)
            local = torch.topk(rows.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
            parts.append(local.reshape(-1))
        if tail:
            last = flat[full * chunk :]
            parts.append(torch.topk(last.abs(), k_tail, sorted=False).indices.sort().values)
        local = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=flat.device)
        values = flat[_global_indices(local, full, k, chunk)]
        if values.numel() and not bool(torch.isfinite(values).all()):
            # the largest magnitudes hold any Inf, and torch.topk ranks NaN above everything
            raise NonFiniteError("chunktopk: input holds NaN or Inf")
        return Encoded({"k": k, "chunk": chunk}, (pack_uints(local, index_width(chunk)),), values)

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        chunk = h.int("chunk", 2, _MAX_CHUNK)
        k = h.int("k", 1, chunk)
        n = math.prod(shape)
        full, tail, k_tail = chunk_counts(n, k, chunk)
        count = full * k + k_tail
        if payload is None or payload.numel() != count:
            got = "no" if payload is None else payload.numel()
            raise PacketError(h.path + "inner.shape", f"{got} values, but {full} chunks of {k} and "
                                                      f"{k_tail} in a last one of {tail} need {count}")
        field = h.path + "indices"
        Header.expect_len(buffers[0], (count * index_width(chunk) + 7) // 8, field)
        local = unpack_uints(buffers[0], count, index_width(chunk))
        _check_indices(local, full, k, chunk, tail, field)
        out = torch.zeros(n, dtype=dtype, device=device)
        out[_global_indices(local.to(device), full, k, chunk)] = payload.to(device=device, dtype=dtype)
        return out


def _global_indices(local: torch.Tensor, full: int, k: int, chunk: int) -> torch.Tensor:
    """Chunk-local indices (K per full chunk, then the last chunk's) as indices into the tensor."""
    offsets = torch.arange(full, dtype=torch.int64, device=local.device).mul_(chunk).repeat_interleave(k)
    if local.numel() > offsets.numel():
        tail = torch.full((local.numel() - offsets.numel(),), full * chunk, dtype=torch.int64, device=local.device)
        offsets = torch.cat((offsets, tail))
    return local + offsets


def _check_indices(local: torch.Tensor, full: int, k: int, chunk: int, tail: int, field: str) -> None:
    rows = [(local[: full * k].view(full, k), chunk)] if full else []
    if tail:
        rows.append((local[full * k :].view(1, -1), tail))
    for idx, length in rows:
        if idx.numel() and int(idx.max()) >= length:
            raise PacketError(field, f"an index is out of its chunk of {length} values")
        if idx.shape[1] > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            raise PacketError(field, "indices must be increasing within a chunk (one is repeated or out of order)")


def _parse_block(text: str) -> int:
    block = int(text)
    if not 1 <= block <= _MAX_CHUNK:
        raise ValueError(f"block must be in [1, 2**24], got {block}")
    return block


@register
class Q2(Compressor):
    """2 bits per value: sign (high bit) and the lower or upper magnitude of its block."""

    codec = "q2"
    stage_lossless = stage_zero_copy = False
    n_buffers = 2
    params = (Param("block", _parse_block, 64),)

    def __init__(self, block: int = 64, inner: Compressor | None = None) -> None:
        super().__init__(inner)
        self.block = _parse_block(str(block))

    def _encode(self, flat, shape, seed, name) -> Encoded:
        x = flat.to(torch.float32)
        mags = x.abs()
        rows = _by_block(mags, self.block, pad=math.inf)  # views of whole blocks; a short tail block
        lo = rows.amin(dim=1)  # is filled out so that it changes neither the min nor the max
        hi = (_by_block(mags, self.block, pad=0.0) if x.numel() % self.block else rows).amax(dim=1)
        if lo.numel() and not bool(torch.isfinite(hi).all()):
            raise NonFiniteError("q2: input holds NaN or Inf")
        # nearer the upper magnitude than the lower, block by block
        upper = rows.sub(lo.unsqueeze(1)).mul_(2).gt_((hi - lo).unsqueeze(1)).view(-1)[: x.numel()]
        codes = torch.signbit(x).to(torch.uint8).mul_(2).add_(upper.to(torch.uint8))
        scales = torch.stack((lo, hi), dim=1).reshape(-1)
        return Encoded({"block": self.block}, (as_bytes(scales), pack_uints(codes, 2)))

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        block = h.int("block", 1, _MAX_CHUNK)
        n = math.prod(shape)
        nblocks = -(-n // block)
        Header.expect_len(buffers[0], 8 * nblocks, h.path + "scales")
        Header.expect_len(buffers[1], (2 * n + 7) // 8, h.path + "codes")
        scales = view_as(buffers[0], torch.float32).view(nblocks, 2)
        if nblocks and not bool((torch.isfinite(scales) & (scales >= 0)).all() and
                                (scales[:, 0] <= scales[:, 1]).all()):
            raise h.error("scales", "NaN, Inf or negative scale, or a lower magnitude above the upper")
        codes = _by_block(unpack_uints(buffers[1], n, 2).to(device), block, pad=0)
        scales = scales.to(device)
        mag = torch.where(codes.bitwise_and(1).bool(), scales[:, 1:], scales[:, :1])
        return torch.where(codes >= 2, -mag, mag).view(-1)[:n].to(dtype)


def _by_block(x: torch.Tensor, block: int, pad: float) -> torch.Tensor:
    """`x` as rows of `block` values, the last row filled out with `pad` (a view when whole)."""
    n = x.numel()
    if n % block == 0:
        return x.view(-1, block)
    rows = x.new_full((-(-n // block) * block,), pad)
    rows[:n] = x
    return rows.view(-1, block)
