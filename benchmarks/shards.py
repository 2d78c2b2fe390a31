"""Every rank syncs its own shard: FSDP2 inside a replica, one sub-swarm per shard rank.

    python benchmarks/shards.py [--ranks 2] [--steps 40] [--warmup 4] [--sync-steps 20]
                                [--only inner|bytes|memory]

Inner steps (`inner` row). One replica of `--ranks` gloo ranks, one process and one torch
thread each, `charlm`. In the same processes and the same run, every rank alternates two kinds
of step on the same batches: a plain FSDP2 step (its own copy of the model under
`fully_shard`, AdamW on the DTensor parameters: zero_grad, forward, backward, step) and a
Starling step (`Trainer.step` of `diloco` with the rank's shard group, alone in its
sub-swarm, `sync_every` above the run so no outer step falls in it, after the per-step
`agree` all-reduce every rank calls). Which goes first alternates every step. Each rank's
median wall time per step of each, after `--warmup`. Target: Starling's within 10% of plain
FSDP2's on every rank (ratio <= 1.10).

Outer-sync bytes (`bytes` row). Simulated swarms of 2 peers, `diloco`, the same model and
`--sync-steps` steps: single-process peers, replicas of `--ranks` ranks whose rank 0 syncs the
whole model, and replicas whose every rank syncs its own shard. The bytes each replica's nodes
sent on protocol topics, and each rank's share. Target: a shard-syncing replica sends what a
single-process peer sends (ratio 1, up to message headers), 1/ranks through each rank.

Memory (`memory` rows). The same swarms of 2 replicas at two depths of `charlm` (`--layers`,
width `--width`, batches of one row): each rank's peak resident memory growth from before its
model was built, and the training state it holds (`held_bytes`: parameters, gradients, inner
optimizer state, outer parameters and momentum, error-feedback residuals). What one more
layer adds (the difference between the depths) is the model's share, free of what does not
grow with the model (libraries, sockets, activations of one row). Target: what a rank's
memory grows per layer is at most 1.10x the state it holds per layer, and a shard-syncing
rank's state is 1/ranks of the rank-0 replica's leader's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch
from step_compare import alternate, plain_step, run_ranks  # benchmarks/step_compare.py, beside this script

from starling.node import Node
from starling.protocols.optim import make_optimizer
from starling.runtime import SimConfig, Simulation, Trainer, TrainSpec
from starling.runtime.replica import ReplicaGroup
from starling.runtime.shard_sync import ShardSync, shard_units
from starling.tasks import get_task

TASK_OPTIONS = {"corpus_chars": 400_000, "n_layer": 4, "n_embd": 128}
TARGET_STEP_RATIO = 1.10
TARGET_MEMORY_RATIO = 1.10
MEMORY_SYNC_EVERY = 8


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def _plain_fsdp2(task: Any, mesh: Any, rank: int, world: int) -> Any:
    """A plain FSDP2 step over a fresh copy of the task's model (the same units as Starling's),
    AdamW as DiLoCo's inner optimizer with its defaults."""
    from torch.distributed.fsdp import fully_shard

    from starling.protocols.diloco_config import DiLoCoConfig

    config = DiLoCoConfig()
    model = task.make_model()
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(list(model.parameters()), config.inner_optimizer, config.lr, config.inner_momentum,
                               config.weight_decay)
    return plain_step(task, model, optimizer, task.batches(rank, world, 0), set_to_none=True)


def _rank(rank: int, ranks: int, init: str, steps: int, warmup: int, out: Any) -> None:
    torch.set_num_threads(1)
    group = ReplicaGroup(rank, ranks, init, timeout_s=120.0)
    group.init()
    task = get_task("charlm", **TASK_OPTIONS)
    node = Node().start("tcp://127.0.0.1:0", [], security="plaintext")
    try:
        spec = TrainSpec("diloco", "charlm", {"sync_every": 10 * (steps + warmup)}, TASK_OPTIONS)
        replication = ShardSync(group)  # the peer's one shard, cut among the ranks: rank `rank` of `ranks`
        trainer = Trainer(node, spec, 0, 1, task=task, serve_state=False, replication=replication)
        trainer.create_protocol()
        plain = _plain_fsdp2(task, replication.sharded.mesh, rank, ranks)  # type: ignore[union-attr]
        batches = trainer.batches()

        def starling() -> None:
            trainer.agree(True)
            trainer.step(next(batches))

        times = alternate(("fsdp2", plain), ("starling", starling), steps, warmup)
        out.put({"rank": rank, **times, "parameters": sum(p.numel() for p in task.make_model().parameters())})
    finally:
        node.close()
        group.close()


def inner_steps(ranks: int, steps: int, warmup: int) -> None:
    by_rank = run_ranks(_rank, ranks, steps, warmup)
    ratios = {r: statistics.median(g["starling"]) / statistics.median(g["fsdp2"]) for r, g in sorted(by_rank.items())}
    got = by_rank[0]
    emit({"row": "inner", "ranks": ranks, "steps": steps, "parameters": got["parameters"], **TASK_OPTIONS,
          "fsdp2_step_ms": round(statistics.median(got["fsdp2"]) * 1e3, 3),
          "starling_step_ms": round(statistics.median(got["starling"]) * 1e3, 3),
          "ratio_by_rank": [round(v, 4) for v in ratios.values()], "target": TARGET_STEP_RATIO,
          "met": max(ratios.values()) <= TARGET_STEP_RATIO})


def _swarm(ranks: int, shard_sync: bool, steps: int, task_options: dict[str, Any], protocol: str = "diloco",
           options: dict[str, Any] | None = None) -> Any:
    common = {"peers": 2, "protocol": protocol, "steps": steps, "options": options or {"sync_every": 5},
              "task_options": task_options}
    if ranks == 1:
        return Simulation(SimConfig(**common, transport="tcp", processes=2)).run()
    return Simulation(SimConfig(**common, nproc_per_replica=ranks, shard_sync=shard_sync)).run()


def _ranks_of(run: Any) -> list[dict[str, Any]]:
    return run.peers[0].protocol_info["replica"]["digests"]


def outer_bytes(ranks: int, steps: int) -> None:
    single = _swarm(1, False, steps, TASK_OPTIONS)
    leader = _swarm(ranks, False, steps, TASK_OPTIONS)
    sharded = _swarm(ranks, True, steps, TASK_OPTIONS)
    per_rank = [d["bytes_sent"] for d in _ranks_of(sharded)]
    base = single.summary["bytes_sent_per_peer"]
    ratio = sharded.summary["bytes_sent_per_peer"] / base
    emit({"row": "bytes", "ranks": ranks, "steps": steps, "sync_every": 5,
          "single_process_bytes_sent": base, "leader_bytes_sent": leader.summary["bytes_sent_per_peer"],
          "shard_sync_bytes_sent": sharded.summary["bytes_sent_per_peer"], "shard_sync_bytes_by_rank": per_rank,
          "ratio": round(ratio, 5), "rank_shares": [round(b / sum(per_rank), 4) for b in per_rank],
          "met": abs(ratio - 1.0) <= 0.01 and all(abs(b / sum(per_rank) - 1 / ranks) <= 0.01 for b in per_rank),
          "eval_loss": {"single_process": single.summary["eval_loss"], "leader": leader.summary["eval_loss"],
                        "shard_sync": sharded.summary["eval_loss"]}})


def memory(ranks: int, steps: int, layers: tuple[int, int], width: int, fragments: int) -> None:
    sync = {"sync_every": max(MEMORY_SYNC_EVERY, fragments), "fragments": fragments}
    for shard_sync in (False, True):
        by_depth = []
        for depth in layers:
            options = {"corpus_chars": 200_000, "n_layer": depth, "n_embd": width, "batch_size": 1, "seq_len": 64,
                       "eval_batches": 1}
            by_depth.append(_ranks_of(_swarm(ranks, shard_sync, steps, options, "streaming-diloco", sync)))
        added = layers[1] - layers[0]
        rows = []
        for k, (small, large) in enumerate(zip(*by_depth)):
            if "held_bytes" not in large:  # a follower of a rank-0 replica: it reports no state
                continue
            held = sum(large["held_bytes"].values()) - sum(small["held_bytes"].values())
            grew = large["peak_rss_growth_bytes"] - small["peak_rss_growth_bytes"]
            rows.append({"rank": k, "held_per_layer_mb": round(held / added / 2**20, 2),
                         "peak_growth_per_layer_mb": round(grew / added / 2**20, 2), "ratio": round(grew / held, 4),
                         "held_at_depth_mb": {str(d): round(sum(r[k]["held_bytes"].values()) / 2**20, 1)
                                              for d, r in zip(layers, by_depth)},
                         "peak_growth_at_depth_mb": {str(d): round(r[k]["peak_rss_growth_bytes"] / 2**20, 1)
                                                     for d, r in zip(layers, by_depth)}})
        emit({"row": "memory", "mode": "shard_sync" if shard_sync else "rank0", "ranks": ranks, "width": width,
              "protocol": "streaming-diloco", **sync,
              "layers": list(layers), "steps": steps, "by_rank": rows, "target": TARGET_MEMORY_RATIO,
              "met": all(r["ratio"] <= TARGET_MEMORY_RATIO for r in rows)})


def main() -> None:
    # Every allocation of 64 KiB or more its own mapping, returned when freed: resident memory
    # then follows what is alive, not what glibc's arenas kept after it was freed (set before
    # the simulations start the processes that read it).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--sync-steps", type=int, default=20, help="steps of the bytes and memory runs")
    parser.add_argument("--layers", type=int, nargs=2, default=(2, 6), help="the two depths of the memory rows")
    parser.add_argument("--width", type=int, default=512, help="the model width of the memory rows")
    parser.add_argument("--fragments", type=int, default=8, help="streaming-diloco's fragments in the memory rows")
    parser.add_argument("--only", choices=("inner", "bytes", "memory"))
    args = parser.parse_args()
    if args.only in (None, "inner"):
        inner_steps(args.ranks, args.steps, args.warmup)
    if args.only in (None, "bytes"):
        outer_bytes(args.ranks, args.sync_steps)
    if args.only in (None, "memory"):
        memory(args.ranks, args.sync_steps, tuple(args.layers), args.width, args.fragments)


if __name__ == "__main__":
    main()
