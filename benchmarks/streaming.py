"""A streamed corpus (`--data stream:...`, `starling.data.streaming`) on generated shard files.

    python benchmarks/streaming.py [--small-mb 4] [--large-mb 64] [--bounded-mb 4] [--shards 8]
                                   [--unit-bytes 4096] [--seq-len 128] [--batch-size 8] [--steps 20]

Prints JSON rows:
- ``first_batch``: seconds from naming the corpus to holding the first unit's batch (listing the
  shards, the ledger's first unit, reading and tokenizing it), the median of nine, on a small
  and a large corpus of `--shards` shards each, and the shard files opened for it. Target: the
  first batch within 10 s, and as soon on the large corpus as on the small one (``ratio`` near
  1): listing reads sizes (a `stat` per shard), never contents;
- ``loader``: units per second read from the small corpus in the ledger's order (on the
  prefetching thread, as a trainer reads them), against steps per second of the gpt task's
  training step (forward, backward and AdamW on its default model) on those batches. Target: the
  loader at 5x the step rate or more (``ratio``);
- ``memory``: the process's resident memory over one epoch of the large corpus, sampled every
  twentieth of it: after the first twentieth, at its peak and at the end. Target: it grows by
  less than a tenth of the corpus's size over the epoch (nothing is held but the unit in hand);
- ``bounded_space``: one epoch of a tiny gpt (1 layer, 16 wide) over a corpus of `--bounded-mb`,
  the gpt task reading the units a `UnitLedger` hands two members, with the run's cache and
  working space (the task's `cache_dir`, ``TMPDIR``, ``XDG_CACHE_HOME``, ``HF_HOME``,
  ``HF_DATASETS_CACHE``) on a tmpfs of a tenth of the corpus's size, mounted for the row and
  unmounted after. Target: every training unit read and trained exactly once (and its shard
  opened once for it), the tmpfs never full: nothing is copied or converted whole. The control,
  ``whole_read``: the same corpus read whole (``--data FOLDER``: converted and tokenized into a
  token file) with its folders on that tmpfs stops for want of space. Mounting needs root on
  Linux; elsewhere the row says it was skipped, and why.

The corpora are JSON lines of generated words (documents of 0 to 2,000 words), in a fresh
temporary folder; the byte tokenizer makes the tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from starling.data.assignment import UnitLedger
from starling.data.prefetch import Prefetcher
from starling.data.streaming import StreamSource, stream_units
from starling.data.tokenizer import ByteTokenizer

FIRST_BATCH_TARGET_S = 10.0
LOADER_TARGET = 5.0
MEMORY_SHARE = 0.1  # of the corpus's size: what the epoch may add to resident memory
SPACE_SHARE = 0.1  # of the corpus's size: the run's cache and working space in `bounded_space`
SPACE_VARIABLES = ("TMPDIR", "XDG_CACHE_HOME", "HF_HOME", "HF_DATASETS_CACHE")  # each a folder on it
TINY_GPT = {"n_layer": 1, "n_embd": 16, "n_head": 2}
WORDS = ("the of and to in is was for on that with as by at from his her an which they were be this are "
         "river mountain signal protocol gradient swarm peer shard ledger epoch unit token stream über café "
         "naïve 東京 données").split()


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def write_corpus(root: Path, total_bytes: int, shards: int, seed: int = 0) -> int:
    """`shards` JSON-lines shards under `root`, about `total_bytes` in all; returns the bytes
    written."""
    rng = random.Random(seed)
    pool = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 2000)))}) + "\n"
            for _ in range(64)]
    root.mkdir(parents=True, exist_ok=True)
    written = 0
    for shard in range(shards):
        lines, size = [], 0
        while size < total_bytes / shards:
            line = rng.choice(pool)
            lines.append(line)
            size += len(line.encode())
        (root / f"shard-{shard:05d}.jsonl").write_text("".join(lines), encoding="utf-8")
        written += size
    return written


def resident_bytes() -> int:
    """The process's resident memory now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def first_batch(root: Path, unit_bytes: int, seq_len: int) -> tuple[float, int, int]:
    """(seconds to the first batch, shard files opened, units) for the corpus at `root`."""
    began = time.perf_counter()
    source = StreamSource(str(root), unit_bytes=unit_bytes)
    [unit] = UnitLedger(source.units, seed=0).advance(0, ["me"])["me"]
    source.unit_batch(unit.index, ByteTokenizer(), seq_len)
    return time.perf_counter() - began, source.opens, source.units


def row_first_batch(small: Path, large: Path, unit_bytes: int, seq_len: int, repeats: int = 9) -> dict[str, Any]:
    results = {}
    for name, root in (("small", small), ("large", large)):
        runs = [first_batch(root, unit_bytes, seq_len) for _ in range(repeats)]
        results[name] = (statistics.median(r[0] for r in runs), max(r[1] for r in runs), runs[0][2],
                         len(list(root.iterdir())))
    (small_s, small_opened, small_units, small_shards) = results["small"]
    (large_s, large_opened, large_units, large_shards) = results["large"]
    ratio = large_s / small_s
    return {"row": "first_batch", "small_shards": small_shards, "small_units": small_units,
            "large_shards": large_shards, "large_units": large_units,
            "small_s": round(small_s, 4), "large_s": round(large_s, 4), "ratio": round(ratio, 2),
            "opened_small": small_opened, "opened_large": large_opened, "target_s": FIRST_BATCH_TARGET_S,
            "met": max(small_s, large_s) < FIRST_BATCH_TARGET_S}


def row_loader(root: Path, unit_bytes: int, seq_len: int, batch_size: int, steps: int) -> dict[str, Any]:
    from starling.tasks import get_task

    tokenizer = ByteTokenizer()
    source = StreamSource(str(root), unit_bytes=unit_bytes)
    ledger = UnitLedger(source.units, seed=1)
    order = [unit.index for round_ in range(source.units) for unit in ledger.advance(round_, ["me"])["me"]]
    count = min(len(order), max(steps + 3, 20 * steps))
    batches = Prefetcher(stream_units(source, order[:count], tokenizer, seq_len), depth=4)
    kept = [next(batches)]  # the prefetching thread is up
    began = time.perf_counter()
    kept.extend(batches)
    loader_rate = (len(kept) - 1) / (time.perf_counter() - began)
    batches.close()

    task = get_task("gpt", seq_len=seq_len, batch_size=batch_size)
    model = task.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch: Any) -> None:
        task.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in kept[:3]:  # warm-up: allocator, autograd graph
        step(batch)
    timed = kept[3:3 + steps]
    began = time.perf_counter()
    for batch in timed:
        step(batch)
    step_rate = len(timed) / (time.perf_counter() - began)
    rows = statistics.mean(batch[0].shape[0] for batch in kept)
    ratio = loader_rate / step_rate
    return {"row": "loader", "units_read": len(kept), "unit_bytes": unit_bytes, "seq_len": seq_len,
            "rows_per_unit": round(rows, 1), "units_per_s": round(loader_rate, 1), "steps_per_s": round(step_rate, 2),
            "ratio": round(ratio, 1), "target": LOADER_TARGET, "met": ratio >= LOADER_TARGET}


def row_memory(root: Path, corpus_bytes: int, unit_bytes: int, seq_len: int) -> dict[str, Any]:
    tokenizer = ByteTokenizer()
    source = StreamSource(str(root), unit_bytes=unit_bytes)
    ledger = UnitLedger(source.units, seed=2)
    every = max(1, source.units // 20)
    samples: list[int] = []
    read = 0
    round_ = 0
    while ledger.epoch == 0 and read < source.units:
        for unit in ledger.advance(round_, ["a", "b"])["a"] + ledger.units_of("b"):
            if unit.epoch:
                continue
            source.unit_batch(unit.index, tokenizer, seq_len)
            read += 1
            if read % every == 0:
                samples.append(resident_bytes())
        round_ += 1
    samples.append(resident_bytes())
    first, peak, last = samples[0], max(samples), samples[-1]
    growth = peak - first
    mb = 1 << 20
    return {"row": "memory", "corpus_mb": round(corpus_bytes / mb, 1), "units": source.units, "units_read": read,
            "rss_first_mb": round(first / mb, 1), "rss_peak_mb": round(peak / mb, 1), "rss_end_mb": round(last / mb, 1),
            "growth_mb": round(growth / mb, 2), "bound_mb": round(MEMORY_SHARE * corpus_bytes / mb, 1),
            "met": read == source.units and growth < MEMORY_SHARE * corpus_bytes}


def space_used(folder: Path) -> int:
    """Bytes in use on the file system that holds `folder`."""
    stat = os.statvfs(folder)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


@contextlib.contextmanager
def size_limited_tmpfs(size_bytes: int) -> Iterator[Path]:
    """A fresh folder with a tmpfs of `size_bytes` mounted on it, unmounted and removed after
    (root on Linux); CalledProcessError if `mount` refuses."""
    folder = Path(tempfile.mkdtemp(prefix="starling-bounded-"))
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)],
                       check=True, capture_output=True, text=True)
        try:
            yield folder
        finally:
            subprocess.run(["umount", str(folder)], check=True, capture_output=True, text=True)
    finally:
        folder.rmdir()


@contextlib.contextmanager
def run_space(folder: Path) -> Iterator[Path]:
    """Point the run's cache and working folders (SPACE_VARIABLES, and the token cache this
    returns) at `folder`, putting them back after."""
    saved = {name: os.environ.get(name) for name in SPACE_VARIABLES}
    saved_tempdir = tempfile.tempdir
    datasets = sys.modules.get("datasets")  # imported already: it read HF_DATASETS_CACHE then
    saved_cache = datasets.config.HF_DATASETS_CACHE if datasets is not None else None
    try:
        for name in SPACE_VARIABLES:
            path = folder / name.lower()
            path.mkdir()
            os.environ[name] = str(path)
        tempfile.tempdir = None  # read TMPDIR again
        if datasets is not None:
            datasets.config.HF_DATASETS_CACHE = Path(os.environ["HF_DATASETS_CACHE"])
        yield folder / "tokens"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = saved_tempdir
        if datasets is not None:
            datasets.config.HF_DATASETS_CACHE = saved_cache


def bounded_epoch(root: Path, space: Path, unit_bytes: int, seq_len: int, batch_size: int) -> dict[str, Any]:
    """One epoch of a tiny gpt over the streamed corpus at `root`, its cache and working folders
    in `space`: the gpt task reads each unit a `UnitLedger` hands two members and trains on it.
    Returns what was read and trained, and the space `space`'s file system held at its peak."""
    from starling.tasks import get_task

    with run_space(space) as cache:
        task = get_task("gpt", data=f"stream:{root}", cache_dir=str(cache), unit_bytes=unit_bytes, seq_len=seq_len,
                        batch_size=batch_size, **TINY_GPT)
        units = task.data_units()
        assert units is not None
        ledger = UnitLedger(units, seed=3)
        model = task.make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        trained: Counter[int] = Counter()
        losses: list[float] = []
        start = peak = space_used(space)
        round_ = 0
        began = time.perf_counter()
        while ledger.epoch == 0:
            for unit in (u for held in ledger.advance(round_, ["a", "b"]).values() for u in held):
                if unit.epoch:
                    continue  # the next epoch's first unit: the epoch is over
                loss = task.loss(model, task.unit_batch(unit.index))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                trained[unit.index] += 1
                losses.append(float(loss.detach()))
                peak = max(peak, space_used(space))
            round_ += 1
        seconds = time.perf_counter() - began
        opened = task.stream.opens
    tenth = max(1, len(losses) // 10)
    return {"units": units, "units_trained": sum(trained.values()), "distinct": len(trained),
            "each_once": set(trained) == set(range(units)) and set(trained.values()) == {1},
            "shard_opens": opened, "space_start": start, "space_peak": peak, "epoch_s": seconds,
            "loss_first": statistics.mean(losses[:tenth]), "loss_last": statistics.mean(losses[-tenth:])}


def whole_conversion(root: Path, space: Path, seq_len: int, batch_size: int) -> str:
    """The control: the same corpus read whole (as ``--data FOLDER`` reads it: converted, then
    tokenized into a token file) with its cache and working folders in `space`. Returns the
    error that stopped it (the space filled), or "" if it fit."""
    from starling.data.base import DataError
    from starling.tasks import get_task

    folder = space / "whole"
    folder.mkdir()
    try:
        with run_space(folder) as cache:
            get_task("gpt", data=str(root), cache_dir=str(cache), seq_len=seq_len, batch_size=batch_size,
                     **TINY_GPT).data_units()
    except (OSError, DataError) as exc:
        return str(exc).strip().splitlines()[-1].replace(f"{root}: ", "")
    return ""


def row_bounded_space(root: Path, corpus_bytes: int, unit_bytes: int, seq_len: int,
                      batch_size: int) -> dict[str, Any]:
    row: dict[str, Any] = {"row": "bounded_space", "corpus_mb": round(corpus_bytes / (1 << 20), 2)}
    if not sys.platform.startswith("linux"):
        return {**row, "skipped": f"a size-limited tmpfs needs Linux, not {sys.platform}"}
    if os.geteuid() != 0:
        return {**row, "skipped": f"mounting a size-limited tmpfs needs root (running as uid {os.geteuid()})"}
    try:
        with size_limited_tmpfs(max(1 << 12, int(SPACE_SHARE * corpus_bytes))) as space:
            stat = os.statvfs(space)
            size = stat.f_blocks * stat.f_frsize  # as mounted: whole pages
            result = bounded_epoch(root, space, unit_bytes, seq_len, batch_size)
            whole = whole_conversion(root, space, seq_len, batch_size)
    except subprocess.CalledProcessError as exc:
        why = (exc.stderr or exc.stdout or "").strip().splitlines()
        return {**row, "skipped": f"{' '.join(exc.cmd[:3])} failed: {why[-1] if why else exc.returncode}"}
    except OSError as exc:  # the space filled (ENOSPC): something was copied or converted whole
        return {**row, "error": f"{type(exc).__name__}: {exc}", "met": False}
    kb = 1 << 10
    met = (result["each_once"] and result["shard_opens"] == result["units"] and result["space_peak"] < size
           and bool(whole))
    return {**row, "tmpfs_kb": round(size / kb, 1), "units": result["units"],
            "units_trained": result["units_trained"], "each_once": result["each_once"],
            "shard_opens": result["shard_opens"], "space_start_kb": round(result["space_start"] / kb, 1),
            "space_peak_kb": round(result["space_peak"] / kb, 1), "epoch_s": round(result["epoch_s"], 1),
            "units_per_s": round(result["units"] / result["epoch_s"], 1),
            "loss_first": round(result["loss_first"], 3), "loss_last": round(result["loss_last"], 3),
            "whole_read": whole or "fit", "met": met}


def run(small_mb: float, large_mb: float, shards: int, unit_bytes: int, seq_len: int, batch_size: int,
        steps: int, bounded_mb: float = 4) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="starling-streaming-") as tmp:
        small, large, bounded = Path(tmp) / "small", Path(tmp) / "large", Path(tmp) / "bounded"
        write_corpus(small, int(small_mb * (1 << 20)), shards, seed=1)
        large_bytes = write_corpus(large, int(large_mb * (1 << 20)), shards, seed=2)
        bounded_bytes = write_corpus(bounded, int(bounded_mb * (1 << 20)), shards, seed=3)
        for make in (lambda: row_first_batch(small, large, unit_bytes, seq_len),
                     lambda: row_loader(small, unit_bytes, seq_len, batch_size, steps),
                     lambda: row_memory(large, large_bytes, unit_bytes, seq_len),
                     lambda: row_bounded_space(bounded, bounded_bytes, unit_bytes, seq_len, batch_size)):
            row = make()
            emit(row)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-mb", type=float, default=4)
    parser.add_argument("--large-mb", type=float, default=64)
    parser.add_argument("--bounded-mb", type=float, default=4)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--unit-bytes", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a peer of a simulator on this box trains on one thread
    run(args.small_mb, args.large_mb, args.shards, args.unit_bytes, args.seq_len, args.batch_size, args.steps,
        args.bounded_mb)


if __name__ == "__main__":
    main()
