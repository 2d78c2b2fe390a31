"""Where a vector's values go in a sharded all-reduce: one contiguous shard per member,
each cut into chunks that a single request carries."""
from __future__ import annotations

import functools

DEFAULT_CHUNK_NUMEL = 1 << 20  # 4 MiB of float32 per request: below glibc's 32 MiB mmap threshold


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges, sizes differing by at most one."""
    base, extra = divmod(numel, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


@functools.lru_cache(maxsize=64)
def chunk_layout(numel: int, parts: int, chunk_numel: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each of `parts` shards, its contiguous [lo, hi) chunks of at most `chunk_numel`
    values, sizes differing by at most one (an empty shard is one empty chunk)."""
    layout = []
    for lo, hi in shard_bounds(numel, parts):
        pieces = max(1, -(-(hi - lo) // chunk_numel))
        layout.append(tuple((lo + a, lo + b) for a, b in shard_bounds(hi - lo, pieces)))
    return tuple(layout)
