"""Checkpoints: a peer's whole training state on disk, written off the training thread.

One store (`CheckpointStore`) keeps every kind of peer's checkpoints: a single process's or a
replica's rank 0's, and those a replica writes when its ranks each sync their own shard. A
checkpoint is a state and its manifest in one directory:

    step-000000300.pt     the state (torch.save of the protocol's state_dict and what the
                          runtime adds: swarm config, task, rank)
    step-000000300.dcp/   or a directory of files that a replica's ranks wrote together
                          (torch.distributed.checkpoint: every rank its chunks)
    step-000000300.json   its manifest: step, size, SHA-256 of the .pt (of each file of the
                          directory), format, metadata

The store finds the newest, checks every byte against the manifest's digests before anything
is read, and prunes the oldest beyond `keep`, whatever the kind. A replica's directories
written before they had manifests (`step-0000000004/` holding `starling.json`) are still read,
with a warning that nothing vouches for their bytes.

Each file is written to a temporary name, fsynced and renamed, and the manifest only after
its state file is durable, so a manifest always names a complete file: a crash mid-write
leaves a temporary file (removed at the next start) and no manifest. Loading checks the size
and the digest before it reads a byte of the state, and reads it with
`torch.load(weights_only=True)`, which rebuilds tensors, containers and plain values and
refuses any other object: a checkpoint never runs code. The same format carries state
transfer to joiners (`Trainer.fetch_state`), so one loader serves both. safetensors would
also refuse code, but holds only a flat map of tensors: the protocols' states nest lists,
maps, integers and optimizer states, which would need a second, hand-written encoding.

`CheckpointStore` reads and writes synchronously; `BackgroundCheckpointer` hands a snapshot
to a writer thread, so the training thread pays only for the copy (`state_dict()` clones).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"step-(\d{9})\.json")
_TMP_SUFFIX = ".tmp"
DIRECTORY_SUFFIX = ".dcp"  # a checkpoint that is a directory of files (a sharded replica's)
LEGACY_MANIFEST = "starling.json"  # inside a sharded replica's directory written before manifests had digests
_LEGACY_NAME = re.compile(r"step-(\d{10})")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often a trainer writes checkpoints."""

    directory: str
    every: int  # steps between checkpoints
    keep: int = 3  # the newest this many stay on disk

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpoint every must be >= 1 step, got {self.every}")
        if self.keep < 1:
            raise ValueError(f"checkpoint keep must be >= 1, got {self.keep}")


class CheckpointError(Exception):
    """A checkpoint is missing, truncated, corrupt, or not one this version can read."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint's manifest (not yet verified against its state file)."""

    step: int
    state_path: Path
    nbytes: int
    sha256: str
    created: float
    meta: dict[str, Any] = field(default_factory=dict)
    # a directory checkpoint: each file's (bytes, SHA-256) by its path inside the directory;
    # None for a state file. Empty for a directory written before manifests had digests.
    files: dict[str, tuple[int, str]] | None = None

    @property
    def is_directory(self) -> bool:
        return self.files is not None


class _HashingWriter:
    """A file that hashes and counts what goes through it (torch.save writes in large chunks)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.digest, self.nbytes = raw, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.nbytes += view.nbytes
        return self.raw.write(view)

    def flush(self) -> None:
        self.raw.flush()


def _file_digest(path: Path) -> tuple[int, str]:
    digest, nbytes = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            nbytes += len(chunk)
    return nbytes, digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_rename(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)
    _fsync_dir(final.parent)


class CheckpointStore:
    """The checkpoints of one peer in `directory`; keeps the newest `keep` of them."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(f"*{_TMP_SUFFIX}"):  # a write a crash cut short
            stale.unlink(missing_ok=True)

    # ------------------------------------------------------------------ writing
    def write(self, step: int, state: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> Checkpoint:
        """Write `state` as the checkpoint of `step` (durable when this returns), then drop the
        oldest beyond `keep`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        stem = f"step-{step:09d}"
        state_path = self.directory / f"{stem}.pt"
        tmp = state_path.with_name(state_path.name + _TMP_SUFFIX)
        try:
            with open(tmp, "wb") as raw:
                out = _HashingWriter(raw)
                torch.save(dict(state), out)  # type: ignore[arg-type]  (a file-like object)
                raw.flush()
                os.fsync(raw.fileno())
            _durable_rename(tmp, state_path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        checkpoint = Checkpoint(step, state_path, out.nbytes, out.digest.hexdigest(), time.time(), dict(meta or {}))
        self._write_manifest(checkpoint, {})
        self._prune()
        return checkpoint

    def directory_for(self, step: int) -> Path:
        """Where the files of a directory checkpoint of `step` go (then `seal` it)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.directory / f"step-{step:09d}{DIRECTORY_SUFFIX}"

    def seal(self, step: int, meta: Mapping[str, Any] | None = None) -> Checkpoint:
        """The files under `directory_for(step)` are all written (by every rank of a replica):
        digest each, write the manifest that makes the checkpoint count (durable when this
        returns), then drop the oldest beyond `keep` and any unsealed directory before it."""
        root = self.directory_for(step)
        if not root.is_dir():
            raise CheckpointError(f"no directory {root.name} to seal")
        files: dict[str, tuple[int, str]] = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            files[path.relative_to(root).as_posix()] = _file_digest(path)
        total = sum(n for n, _ in files.values())
        summary = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()
        checkpoint = Checkpoint(step, root, total, summary, time.time(), dict(meta or {}), files)
        self._write_manifest(checkpoint, {"files": {name: list(v) for name, v in files.items()}})
        for stale in self.directory.glob(f"step-*{DIRECTORY_SUFFIX}"):  # a write a crash cut short
            if stale.name < root.name and not stale.with_suffix(".json").exists():
                shutil.rmtree(stale, ignore_errors=True)
        self._prune()
        return checkpoint

    def _write_manifest(self, checkpoint: Checkpoint, extra: Mapping[str, Any]) -> None:
        manifest = {"format": FORMAT, "step": checkpoint.step, "state": checkpoint.state_path.name,
                    "nbytes": checkpoint.nbytes, "sha256": checkpoint.sha256, "created": checkpoint.created,
                    "meta": checkpoint.meta, **extra}
        manifest_path = self.directory / f"step-{checkpoint.step:09d}.json"
        tmp = manifest_path.with_name(manifest_path.name + _TMP_SUFFIX)
        with open(tmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        _durable_rename(tmp, manifest_path)

    def _prune(self) -> None:
        for old in self.list()[self.keep:]:
            if old.state_path.suffix in (".pt", DIRECTORY_SUFFIX):  # the manifest first: it makes one count
                self.directory.joinpath(f"step-{old.step:09d}.json").unlink(missing_ok=True)
            if old.is_directory:
                shutil.rmtree(old.state_path, ignore_errors=True)
            else:
                old.state_path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ reading
    def list(self) -> list[Checkpoint]:
        """Every checkpoint whose manifest reads, newest first, of every kind. A manifest that
        does not read is skipped with a warning (its state is not trusted either)."""
        found = []
        for path in self.directory.glob("step-*.json"):
            if not _NAME.fullmatch(path.name):
                continue
            try:
                found.append(self._manifest(path))
            except CheckpointError as exc:
                log.warning("skipping checkpoint %s: %s", path.name, exc)
        found.extend(self._legacy_directories())
        return sorted(found, key=lambda c: c.step, reverse=True)

    def _legacy_directories(self) -> list[Checkpoint]:
        """A sharded replica's directories written before manifests had digests."""
        found = []
        for path in self.directory.glob("step-*"):
            if not _LEGACY_NAME.fullmatch(path.name) or not (path / LEGACY_MANIFEST).is_file():
                continue
            try:
                meta = json.loads((path / LEGACY_MANIFEST).read_text())
                if not isinstance(meta, dict):
                    raise ValueError("not a map")
            except (OSError, ValueError) as exc:
                log.warning("skipping checkpoint %s: %s", path.name, exc)
                continue
            found.append(Checkpoint(int(path.name[5:]), path, 0, "", path.stat().st_mtime, meta, {}))
        return found

    def _manifest(self, path: Path) -> Checkpoint:
        try:
            m = json.loads(path.read_text())
            if m.get("format") != FORMAT:
                raise CheckpointError(f"format {m.get('format')!r}, this version reads {FORMAT}")
            name, stem = str(m["state"]), f"step-{int(m['step']):09d}"
            files = None
            if name == stem + DIRECTORY_SUFFIX:
                files = {str(k): (int(v[0]), str(v[1])) for k, v in dict(m["files"]).items()}
                if any(k.startswith("/") or ".." in k.split("/") for k in files):
                    raise CheckpointError("manifest names a file outside its checkpoint")
            elif name != stem + ".pt":
                raise CheckpointError(f"manifest names an unexpected state file {name!r}")
            return Checkpoint(int(m["step"]), path.with_name(name), int(m["nbytes"]), str(m["sha256"]),
                              float(m["created"]), dict(m.get("meta") or {}), files)
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise CheckpointError(f"unreadable manifest: {type(exc).__name__}: {exc}") from None

    def verify(self, checkpoint: Checkpoint) -> None:
        """CheckpointError unless every byte of a directory checkpoint is what its manifest
        says (a state file is checked as `load` reads it)."""
        if not checkpoint.is_directory:
            self.load(checkpoint)
            return
        if not checkpoint.files:
            log.warning("checkpoint %s was written before manifests had digests: its bytes are not checked",
                        checkpoint.state_path.name)
            return
        for name, (nbytes, sha) in checkpoint.files.items():
            path = checkpoint.state_path / name
            try:
                got = _file_digest(path)
            except OSError as exc:
                raise CheckpointError(f"step {checkpoint.step}: cannot read {name}: {exc}") from None
            if got[0] != nbytes:
                raise CheckpointError(f"step {checkpoint.step}: {name} has {got[0]} bytes, its manifest says "
                                      f"{nbytes} (truncated?)")
            if got[1] != sha:
                raise CheckpointError(f"step {checkpoint.step}: {name} does not match its digest")

    def latest_directory(self) -> Checkpoint | None:
        """The newest directory checkpoint that verifies; a bad one is logged and the one
        before it tried. None if there is none."""
        for checkpoint in self.list():
            if not checkpoint.is_directory:
                continue
            try:
                self.verify(checkpoint)
                return checkpoint
            except CheckpointError as exc:
                log.error("refusing checkpoint %s: %s; trying the one before", checkpoint.state_path.name, exc)
        return None

    def load(self, checkpoint: Checkpoint, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """The state of `checkpoint`, after checking its size and digest; CheckpointError if
        it is truncated, corrupt or not a state this version can read."""
        try:
            data = checkpoint.state_path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"step {checkpoint.step}: cannot read {checkpoint.state_path.name}: {exc}") from None
        if len(data) != checkpoint.nbytes:
            raise CheckpointError(f"step {checkpoint.step}: {checkpoint.state_path.name} has {len(data)} bytes, "
                                  f"its manifest says {checkpoint.nbytes} (truncated?)")
        if hashlib.sha256(data).hexdigest() != checkpoint.sha256:
            raise CheckpointError(f"step {checkpoint.step}: {checkpoint.state_path.name} does not match its digest")
        try:
            state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as exc:  # a digest that matches a file torch cannot read: a foreign file
            raise CheckpointError(f"step {checkpoint.step}: not a readable state: "
                                  f"{type(exc).__name__}: {exc}") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"step {checkpoint.step}: the state is a {type(state).__name__}, not a map")
        return state

    def load_latest(self, map_location: str | torch.device = "cpu",
                    at_most: int | None = None) -> tuple[Checkpoint, dict[str, Any]] | None:
        """The newest checkpoint (of a step <= `at_most`, if given) that verifies and reads;
        a bad one is logged and the one before it tried. None if there is none."""
        for checkpoint in self.list():
            if checkpoint.is_directory or (at_most is not None and checkpoint.step > at_most):
                continue
            try:
                return checkpoint, self.load(checkpoint, map_location)
            except CheckpointError as exc:
                log.error("refusing checkpoint %s: %s; trying the one before", checkpoint.state_path.name, exc)
        return None


class BackgroundCheckpointer:
    """Writes checkpoints on a thread of its own. `save` returns at once with a future; the
    state it is given must already be a private copy (a `state_dict()` is).

    At most one write runs and one waits: a save that comes while another waits replaces it
    (its future is cancelled), so a slow disk costs skipped checkpoints, never memory."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self._lock = threading.Condition()
        self._waiting: tuple[int, Mapping[str, Any], Mapping[str, Any] | None,
                             concurrent.futures.Future[Checkpoint]] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="starling-checkpoint", daemon=True)
        self._thread.start()

    def save(self, step: int, state: Mapping[str, Any],
             meta: Mapping[str, Any] | None = None) -> concurrent.futures.Future[Checkpoint]:
        future: concurrent.futures.Future[Checkpoint] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("checkpointer is closed")
            if self._waiting is not None:
                log.warning("checkpoint of step %d skipped: the disk is behind (step %d replaces it)",
                            self._waiting[0], step)
                self._waiting[3].cancel()
            self._waiting = (step, state, meta, future)
            self._lock.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._waiting is None and not self._closed:
                    self._lock.wait()
                if self._waiting is None:
                    return
                step, state, meta, future = self._waiting
                self._waiting = None
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.store.write(step, state, meta))
            except BaseException as exc:  # reported through the future, never lost in the thread
                log.exception("checkpoint of step %d failed", step)
                future.set_exception(exc)

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the write in progress and the one waiting, then stop the thread."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout_s)
