"""Shards and chunks: how a vector is cut for a round of the sharded all-reduce."""
from __future__ import annotations

from starling.collectives import chunk_layout, shard_bounds


def test_shard_bounds_cover_the_vector():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]

def test_chunk_layout_splits_each_shard_into_near_equal_runs():
    assert chunk_layout(10, 2, 2) == (((0, 2), (2, 4), (4, 5)), ((5, 7), (7, 9), (9, 10)))
    assert chunk_layout(3, 4, 7) == (((0, 1),), ((1, 2),), ((2, 3),), ((3, 3),))  # an empty shard: one empty chunk
