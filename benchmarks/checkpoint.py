"""Checkpoint cost against plain copies and plain writes of the same bytes, in the same run.

    python benchmarks/checkpoint.py [--params-m 100] [--repeats 3] [--dir DIR] [--quick]

Prints one JSON row per repeat and a summary row. Targets checked:
- ``pause``: the training thread's pause for a checkpoint of a 100M-parameter state (a
  float32 model of ``--params-m`` million values: what `Protocol.state_dict()` copies, then the
  hand-off to the writer thread) is at most 1.5x the time of one ``clone()`` of every tensor
  of the same state;
- ``write``: the writer's throughput (torch.save through a hashing file, fsync, rename, a
  manifest, its fsync) is at least 50% of a plain sequential write of the same bytes (the
  tensors' raw bytes to one file, then fsync) on the same disk.

Clone and pause alternate, and so do the two writes, so both sides of each ratio see the same
load; each ratio is of medians. The directory defaults to one under the system's temp dir
(the disk checkpoints would go to in a default setup); ``--dir`` points elsewhere.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from starling.runtime.checkpoint import BackgroundCheckpointer, CheckpointStore

PAUSE_TARGET = 1.5
WRITE_TARGET = 0.5


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def make_model(params_m: float) -> nn.Module:
    """Square float32 layers holding about `params_m` million parameters."""
    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def snapshot(model: nn.Module) -> dict[str, Any]:
    """What a protocol's state_dict() does for the model: a private copy of every tensor."""
    return {"step": 0, "model": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def plain_write(path: Path, state: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for tensor in state.values():
            f.write(memoryview(tensor.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-m", type=float, default=100.0, help="millions of float32 parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a new temp dir, removed after)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4M parameters, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.params_m, args.repeats = 4.0, 2

    torch.manual_seed(0)
    model = make_model(args.params_m)
    numel = sum(v.numel() for v in model.state_dict().values())
    nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="starling-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(root / "store", keep=1)
    writer = BackgroundCheckpointer(store)
    clones, pauses, writes, plains = [], [], [], []
    try:
        for repeat in range(args.repeats):
            t = time.perf_counter()
            copy = clone_state(model)
            clones.append(time.perf_counter() - t)
            del copy

            t = time.perf_counter()
            future = writer.save(repeat, snapshot(model))
            pauses.append(time.perf_counter() - t)
            t = time.perf_counter()
            future.result()
            writes.append(time.perf_counter() - t)  # from the hand-off until it is durable

            state = clone_state(model)
            t = time.perf_counter()
            plain_write(root / "plain.bin", state)
            plains.append(time.perf_counter() - t)
            del state
            (root / "plain.bin").unlink()
            emit({"bench": "checkpoint", "repeat": repeat, "clone_s": round(clones[-1], 4),
                  "pause_s": round(pauses[-1], 4), "write_s": round(writes[-1], 3),
                  "plain_write_s": round(plains[-1], 3)})
    finally:
        writer.close()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    clone_s, pause_s = statistics.median(clones), statistics.median(pauses)
    write_s, plain_s = statistics.median(writes), statistics.median(plains)
    pause_ratio, write_ratio = pause_s / clone_s, plain_s / write_s
    emit({"bench": "checkpoint_summary", "params": numel, "state_mb": round(nbytes / 2**20, 1),
          "clone_s": round(clone_s, 4), "pause_s": round(pause_s, 4), "pause_vs_clone": round(pause_ratio, 3),
          "pause_target": PAUSE_TARGET, "pause_target_met": pause_ratio <= PAUSE_TARGET,
          "write_MBps": round(nbytes / write_s / 1e6, 1), "plain_write_MBps": round(nbytes / plain_s / 1e6, 1),
          "write_vs_plain": round(write_ratio, 3), "write_target": WRITE_TARGET,
          "write_target_met": write_ratio >= WRITE_TARGET})


if __name__ == "__main__":
    main()
