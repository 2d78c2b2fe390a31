"""benchmarks/streaming.py on small corpora: its rows, and the behaviour they rest on (one shard
opened for the first batch, whatever the corpus's size; a whole epoch read)."""
from __future__ import annotations

from conftest import load_benchmark


def test_small_run_prints_the_three_rows(capsys):
    bench = load_benchmark("streaming")
    rows = bench.run(small_mb=0.25, large_mb=2, shards=4, unit_bytes=2048, seq_len=32, batch_size=2, steps=3)
    first, loader, memory = rows
    assert [r["row"] for r in rows] == ["first_batch", "loader", "memory"]
    assert first["large_shards"] == first["small_shards"] == 4 and first["large_units"] > 4 * first["small_units"]
    assert first["opened_small"] == first["opened_large"] == 1
    assert loader["units_read"] >= 6 and loader["rows_per_unit"] > 1 and loader["units_per_s"] > 0
    assert memory["units_read"] == memory["units"] and memory["rss_peak_mb"] >= memory["rss_first_mb"]
    assert capsys.readouterr().out.count("\n") == 3  # one JSON line a row
