"""The data pipeline against the training step it feeds, in the same run.

    python benchmarks/data.py [--data PATH] [--tokenizer bytes] [--seq-len 128] [--batch-size 8] [--steps 30]

Prints JSON rows:
- ``tokenize``: the one-off cost of turning the corpus into its token file (documents, tokens,
  seconds, tokens per second), then the same build again, which finds the file in its cache;
- ``loader``: batches per second of the gpt task's loader (units read from the memory-mapped
  token file, packed into rows and batched, on the prefetching thread), against steps per second
  of that task's training step (forward, backward and AdamW on the default gpt model) on the
  same batches. Target: the loader makes batches at 5x or more the step rate (``ratio``);
- ``churn`` (with ``--churn``): a simulated swarm of 16 peers (threads, allreduce, a small gpt on
  a slice of the stdlib source) in which one peer is SIGKILL-like killed and one joins every
  ``--churn-every`` steps, run until the first epoch is over: units of that epoch trained twice
  (target: at most 0.5% of those trained) and never trained (target: at most the units the
  killed peers held in flight, one each). A unit is trained when the swarm's update holds a
  step's work on it; steps whose work counted nowhere (``steps_not_counted``: a late round,
  a round that went on without the peer) are reported beside it, with ``stepped_twice``.

The default corpus is the running Python's standard library source (no download), tokenized
byte by byte into a fresh cache folder, so the first build is measured too.
"""
from __future__ import annotations

import argparse
import collections
import json
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from starling.data.sources import open_source
from starling.data.tokens import TokenStore
from starling.tasks import get_task

LOADER_TARGET = 5.0
REPEAT_TARGET = 0.005


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def churn(args: argparse.Namespace) -> None:
    from starling.runtime import SimConfig, Simulation, parse_churn

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        size = 0
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):  # about 600 units
            if size > 80_000:
                break
            text = path.read_text(encoding="utf-8")
            (corpus / path.name).write_text(text, encoding="utf-8")
            size += len(text.encode())
        options = {"data": str(corpus), "seq_len": "32", "batch_size": "4", "n_embd": "16", "n_layer": "1",
                   "cache_dir": str(Path(tmp) / "tokens")}
        units = get_task("gpt", **options).data_units()
        peers, every = 16, args.churn_every
        steps = units // peers + 3 * every  # the joiners take the killed peers' places: the epoch ends
        if not args.churn_joins:
            steps = 2 * units // peers  # the swarm shrinks to half
        events = [f"kill:{rank + 1}@{every * (rank + 1)}" + (f",join@{every * (rank + 1) + every // 2}"
                                                             if args.churn_joins else "")
                  for rank in range(steps // every - 1)]
        config = SimConfig(peers=peers, steps=steps, protocol="allreduce", task="gpt", transport="inproc",
                           churn=parse_churn(",".join(events)), task_options=options, seed=1)
        result = Simulation(config).run()
        records = [r for p in result.peers for r in p.records if "unit" in r]
        # A unit is trained when the swarm's update holds the work of a step on it; a step whose
        # work counted nowhere (the round went on without it, or its round was late) trained
        # nothing, and its unit goes back to the pool. Steps on units are reported too.
        trained = collections.Counter(tuple(r["unit"]) for r in records if r.get("unit_counted", True))
        stepped = collections.Counter(tuple(r["unit"]) for r in records)
        epoch0 = {index: n for (epoch, index), n in trained.items() if epoch == 0}
        stepped0 = {index: n for (epoch, index), n in stepped.items() if epoch == 0}
        over = any(epoch > 0 for epoch, _ in trained)
        kills = sum(1 for p in result.peers if p.status == "killed")
        twice = sum(n - 1 for n in epoch0.values())
        never = units - len(epoch0) if over else None
        emit({"row": "churn", "joins_too": args.churn_joins, "peers": peers, "steps": steps, "units": units,
              "kills": kills,
              "joins": len(result.peers) - peers, "epoch_over": over, "trained": sum(epoch0.values()),
              "trained_twice": twice, "twice_share": round(twice / max(1, sum(epoch0.values())), 4),
              "never_trained": never, "never_bound": kills,
              "steps_on_units": sum(stepped0.values()), "stepped_twice": sum(n - 1 for n in stepped0.values()),
              "steps_not_counted": sum(stepped0.values()) - sum(epoch0.values()),
              "wall_s": round(result.summary["wall_s"], 1),
              "met": over and twice <= REPEAT_TARGET * sum(epoch0.values()) and never is not None and never <= kills})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="")
    parser.add_argument("--tokenizer", default="bytes")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--churn", action="store_true", help="also the churn row (a simulated swarm)")
    parser.add_argument("--churn-every", type=int, default=6)
    parser.add_argument("--no-churn-joins", dest="churn_joins", action="store_false",
                        help="churn with kills only (the joiners' part of the figures apart)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a peer of a simulator on this box trains on one thread

    with tempfile.TemporaryDirectory() as cache:
        task = get_task("gpt", data=args.data, tokenizer=args.tokenizer, seq_len=args.seq_len,
                        batch_size=args.batch_size, cache_dir=cache)
        source = open_source(args.data)
        began = time.perf_counter()
        store = TokenStore.build(source, task.tokenizer, cache)
        built_s = time.perf_counter() - began
        began = time.perf_counter()
        TokenStore.build(source, task.tokenizer, cache)
        cached_s = time.perf_counter() - began
        emit({"row": "tokenize", "data": args.data or "stdlib", "tokenizer": args.tokenizer, "tokens": len(store),
              "seconds": round(built_s, 3), "tokens_per_s": round(len(store) / built_s),
              "cached_seconds": round(cached_s, 4)})

        units = task.data_units()
        batches = task.batches(0, 1, 0)
        next(batches)  # the prefetching thread is up
        n = args.steps * 20
        began = time.perf_counter()
        kept = [next(batches) for _ in range(n)]
        loader_rate = n / (time.perf_counter() - began)
        batches.close()

        model = task.make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for batch in kept[:3]:  # warm-up: allocator, autograd graph
            task.loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        began = time.perf_counter()
        for batch in kept[3:3 + args.steps]:
            task.loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        step_rate = args.steps / (time.perf_counter() - began)
        ratio = loader_rate / step_rate
        emit({"row": "loader", "units": units, "seq_len": args.seq_len, "batch_size": args.batch_size,
              "batches_per_s": round(loader_rate, 1), "steps_per_s": round(step_rate, 2),
              "ratio": round(ratio, 1), "target": LOADER_TARGET, "met": ratio >= LOADER_TARGET})
    if args.churn:
        churn(args)


if __name__ == "__main__":
    main()
