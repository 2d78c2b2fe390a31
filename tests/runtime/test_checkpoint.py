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
from cli_zygote import cli_popen

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
        proc = cli_popen([sys.executable, "-c", _WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
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


# ---------------------------------------------------------------------- one store for every kind
def _replica_files(store: CheckpointStore, step: int, ranks: int = 2) -> None:
    """What a sharded replica's ranks leave in `directory_for(step)`: a file per rank, and metadata."""
    root = store.directory_for(step)
    root.mkdir()
    for rank in range(ranks):
        torch.save({"chunk": torch.full((4,), float(step * 10 + rank))}, root / f"__{rank}_0.distcp")
    (root / ".metadata").write_bytes(pickle.dumps({"step": step}))


def test_a_sharded_replicas_directories_are_sealed_verified_and_pruned_by_the_same_store(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (4, 8, 12):
        _replica_files(store, step)
        sealed = store.seal(step, {"step": step * 3, "count": step, "ranks": 2, "swarm": {"protocol": "diloco"}})
        assert sealed.is_directory and set(sealed.files) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000008.dcp", "step-000000008.json",
                                                          "step-000000012.dcp", "step-000000012.json"]
    newest = store.latest_directory()
    assert newest is not None and newest.step == 12 and newest.meta["count"] == 12
    assert store.load_latest() is None  # a directory is not a state file: the file loader passes it by


def test_a_corrupted_file_of_a_directory_checkpoint_is_refused_by_its_digest(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep=3)
    for step in (4, 8):
        _replica_files(store, step)
        store.seal(step, {"count": step})
    chunk = store.directory_for(8) / "__1_0.distcp"
    data = bytearray(chunk.read_bytes())
    data[-3] ^= 0xFF  # same size, one byte flipped
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__1_0.distcp does not match its digest"):
        store.verify(store.list()[0])
    assert store.latest_directory().step == 4
    assert "refusing checkpoint step-000000008.dcp" in caplog.text
    (store.directory_for(4) / "__0_0.distcp").unlink()
    assert store.latest_directory() is None  # nothing left that verifies


def test_an_unsealed_directory_does_not_count_and_is_removed_when_a_later_one_is_sealed(tmp_path):
    store = CheckpointStore(tmp_path)
    _replica_files(store, 4)  # a crash before rank 0 sealed it
    assert store.list() == [] and store.latest_directory() is None
    _replica_files(store, 8)
    store.seal(8)
    assert not store.directory_for(4).exists() and store.latest_directory().step == 8


def test_a_manifest_naming_files_outside_its_directory_is_skipped(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    _replica_files(store, 4)
    store.seal(4)
    manifest = tmp_path / "step-000000004.json"
    m = json.loads(manifest.read_text())
    m["files"]["../../etc/passwd"] = [1, "0" * 64]
    manifest.write_text(json.dumps(m))
    assert store.list() == [] and "outside its checkpoint" in caplog.text


def test_old_checkpoints_of_every_mode_are_read_by_the_one_store(tmp_path, caplog):
    """A single peer's (and a replica's rank 0's: the same file) and a sharded replica's
    directory from before manifests had digests (`step-0000000004/starling.json`)."""
    single = CheckpointStore(tmp_path / "single")
    single.write(6, _state(6), meta={"swarm": {"protocol": "diloco"}})
    found = single.load_latest()
    assert found is not None and found[0].step == 6 and found[0].meta["swarm"]["protocol"] == "diloco"

    legacy = tmp_path / "sharded" / "step-0000000004"
    legacy.mkdir(parents=True)
    torch.save({"chunk": torch.ones(2)}, legacy / "__0_0.distcp")
    (legacy / "starling.json").write_text(json.dumps({"step": 12, "count": 4, "ranks": 2,
                                                       "swarm": {"protocol": "streaming-diloco"}}))
    store = CheckpointStore(tmp_path / "sharded", keep=1)
    old = store.latest_directory()
    assert old is not None and old.step == 4 and old.state_path == legacy and old.meta["ranks"] == 2
    assert "written before manifests had digests" in caplog.text
    from starling.runtime.launch import newest_checkpoint_spec

    assert newest_checkpoint_spec(tmp_path / "sharded").protocol == "streaming-diloco"
    _replica_files(store, 8)
    store.seal(8)  # a newer one in the new format: the old one is pruned as any other
    assert not legacy.exists() and store.latest_directory().step == 8
