"""benchmarks/streaming.py on small corpora: its rows, and the behaviour they rest on (one shard
opened for the first batch, whatever the corpus's size; a whole epoch read; an epoch trained
with every unit once, writing nothing to the run's cache and working space)."""
from __future__ import annotations

import os

from conftest import load_benchmark


def test_small_run_prints_the_four_rows(capsys):
    bench = load_benchmark("streaming")
    before = {name: os.environ.get(name) for name in bench.SPACE_VARIABLES}
    rows = bench.run(small_mb=0.25, large_mb=2, shards=4, unit_bytes=2048, seq_len=32, batch_size=2, steps=3,
                     bounded_mb=0.25)
    first, loader, memory, bounded = rows
    assert [r["row"] for r in rows] == ["first_batch", "loader", "memory", "bounded_space"]
    assert first["large_shards"] == first["small_shards"] == 4 and first["large_units"] > 4 * first["small_units"]
    assert first["opened_small"] == first["opened_large"] == 1
    assert loader["units_read"] >= 6 and loader["rows_per_unit"] > 1 and loader["units_per_s"] > 0
    assert memory["units_read"] == memory["units"] and memory["rss_peak_mb"] >= memory["rss_first_mb"]
    if "skipped" in bounded:  # no tmpfs without root on Linux: the row says so
        assert "tmpfs" in bounded["skipped"] or "mount" in bounded["skipped"]
    else:
        assert bounded["each_once"] and bounded["units_trained"] == bounded["units"] == bounded["shard_opens"]
        assert bounded["space_peak_kb"] < bounded["tmpfs_kb"] <= 0.1 * bounded["corpus_mb"] * 1024 + 4
        assert "No space left" in bounded["whole_read"]  # the control: the corpus read whole does not fit
        assert bounded["met"]
    assert capsys.readouterr().out.count("\n") == 4  # one JSON line a row
    assert {name: os.environ.get(name) for name in bench.SPACE_VARIABLES} == before  # put back


def test_without_root_the_bounded_row_says_it_was_skipped(tmp_path, monkeypatch):
    bench = load_benchmark("streaming")
    monkeypatch.setattr(bench.sys, "platform", "linux")
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    row = bench.row_bounded_space(tmp_path, 1 << 20, unit_bytes=1024, seq_len=16, batch_size=2)
    assert row == {"row": "bounded_space", "corpus_mb": 1.0,
                   "skipped": "mounting a size-limited tmpfs needs root (running as uid 1000)"}


def test_an_epoch_trains_every_unit_once_and_writes_nothing_to_the_run_space(tmp_path):
    bench = load_benchmark("streaming")
    before = {name: os.environ.get(name) for name in bench.SPACE_VARIABLES}
    corpus_bytes = bench.write_corpus(tmp_path / "corpus", 1 << 17, shards=3, seed=4)
    space = tmp_path / "space"
    space.mkdir()
    result = bench.bounded_epoch(tmp_path / "corpus", space, unit_bytes=1024, seq_len=16, batch_size=2)
    assert result["each_once"] and result["units_trained"] == result["units"] == result["shard_opens"]
    assert result["units"] >= corpus_bytes // 1024 - 4  # all but the held-out units
    assert result["loss_last"] < result["loss_first"]
    # the task's cache, TMPDIR and the caches pointed at the space: nothing was written there
    assert not [p for p in space.rglob("*") if p.is_file()]
    assert {name: os.environ.get(name) for name in bench.SPACE_VARIABLES} == before
