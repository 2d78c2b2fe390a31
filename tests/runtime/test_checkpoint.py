"""Checkpoints on a real disk: exact round trips, refusals of truncated, corrupt and foreign
files with a fallback to the one before, pruning, the writer thread, and a writer process
killed with SIGKILL mid-write."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from starling.runtime.checkpoint import BackgroundCheckpointer, CheckpointError, CheckpointStore


def _state(step: int) -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"step": step, "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "outer": [torch.randn(5), torch.arange(7, dtype=torch.int64)], "versions": [step, step + 1],
            "inner_optimizer": opt.state_dict(), "in_flight": [{"fragment": 0, "round": 2, "members": ["a", "b"],
                                                                "delta": torch.full((3,), 0.5)}],
            "note": "x", "half": torch.randn(4).to(torch.bfloat16)}


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip_is_exact_and_carries_its_metadata(tmp_path):
    store = CheckpointStore(tmp_path)
    state = _state(300)
    written = store.write(300, state, meta={"swarm": {"protocol": "diloco"}, "rank": 1})
    assert written.nbytes == written.state_path.stat().st_size
    checkpoint, loaded = store.load_latest()
    assert checkpoint.step == 300 and checkpoint.meta == {"swarm": {"protocol": "diloco"}, "rank": 1}
    _assert_same(state, loaded)


def test_only_the_newest_keep_survive(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.write(step, {"step": step})
    assert [c.step for c in store.list()] == [30, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000000020.json", "step-000000020.pt", "step-000000030.json", "step-000000030.pt"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_checkpoint_is_refused_and_the_one_before_is_loaded(tmp_path, damage, caplog):
    store = CheckpointStore(tmp_path)
    store.write(10, _state(10))
    newest = store.write(20, _state(20))
    data = bytearray(newest.state_path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray()
    newest.state_path.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match="step 20"):
        store.load(newest)
    checkpoint, state = store.load_latest()
    assert checkpoint.step == 10 and state["step"] == 10
    assert "refusing checkpoint step-000000020.pt" in caplog.text


class _RunsCode:
    """Unpickling this calls a function: what a weights-only load must refuse."""

    def __reduce__(self):
        return (os.getpid, ())


def test_a_file_that_would_run_code_is_refused_even_with_a_matching_digest(tmp_path):
    store = CheckpointStore(tmp_path)
    store.write(5, {"step": 5})
    written = store.write(6, {"step": 6})
    # A pickle of an arbitrary object, with a manifest that vouches for it.
    evil = pickle.dumps({"step": 6, "payload": _RunsCode()}, protocol=2)
    written.state_path.write_bytes(evil)
    manifest = tmp_path / "step-000000006.json"
    m = json.loads(manifest.read_text())
    m.update(nbytes=len(evil), sha256=hashlib.sha256(evil).hexdigest())
    manifest.write_text(json.dumps(m))

    with pytest.raises(CheckpointError, match="not a readable state"):
        store.load(store.list()[0])
    assert store.load_latest()[0].step == 5


def test_a_broken_manifest_is_skipped(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    store.write(1, {"step": 1})
    (tmp_path / "step-000000002.json").write_text("{not json")
    (tmp_path / "step-000000003.json").write_text(json.dumps({"format": 99, "step": 3}))
    assert [c.step for c in store.list()] == [1]
    assert "skipping checkpoint step-000000002.json" in caplog.text
    assert "format 99" in caplog.text


def test_at_most_picks_the_newest_checkpoint_not_after_a_step(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    for step in (10, 20, 30):
        store.write(step, {"step": step})
    assert store.load_latest(at_most=25)[0].step == 20
    assert store.load_latest(at_most=5) is None


def test_background_writes_finish_on_close_and_a_waiting_save_is_replaced(tmp_path):
    store = CheckpointStore(tmp_path, keep=10)
    writer = BackgroundCheckpointer(store)
    futures = [writer.save(step, {"step": step, "x": torch.randn(1000)}) for step in range(1, 6)]
    writer.close()
    done = [f for f in futures if not f.cancelled()]
    assert futures[-1] in done and all(f.result().step > 0 for f in done)
    assert store.list()[0].step == 5
    # every save either became a checkpoint or was replaced by a later one
    assert {c.step for c in store.list()} == {f.result().step for f in done}
    with pytest.raises(RuntimeError, match="closed"):
        writer.save(7, {})


def test_a_failed_write_is_reported_through_its_future_and_leaves_nothing(tmp_path):
    store = CheckpointStore(tmp_path)
    writer = BackgroundCheckpointer(store)
    future = writer.save(1, {"step": 1, "unpicklable": lambda: None})
    writer.close()
    with pytest.raises(Exception, match="pickle"):
        future.result()
    assert list(tmp_path.iterdir()) == []


_WRITER = textwrap.dedent("""
    import sys, torch
    from starling.runtime.checkpoint import CheckpointStore
    store = CheckpointStore(sys.argv[1], keep=3)
    big = torch.randn(4_000_000)
    step = 0
    while True:
        step += 1
        store.write(step, {"step": step, "big": big})
        print(step, flush=True)
""")


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_a_loadable_newest_checkpoint(tmp_path):
    """SIGKILL at random points of a 16 MB write loop: what the manifests name always loads."""
    for attempt in range(3):
        directory = tmp_path / f"run{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            for _ in range(2 + attempt):  # at least two checkpoints are durable
                assert proc.stdout.readline().strip()
            time.sleep(0.01 * attempt)  # somewhere inside the next write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        store = CheckpointStore(directory)  # removes what the kill cut short
        assert not list(directory.glob("*.tmp"))
        checkpoint, state = store.load_latest()
        assert state["step"] == checkpoint.step >= 2 + attempt - 1
        assert state["big"].numel() == 4_000_000
