"""Replicas of many ranks: what Starling adds inside a replica, and what a replica
sends to the swarm.

    python benchmarks/replicas.py [--ranks 2] [--steps 60] [--warmup 6] [--sync-steps 24]

Inner steps (`inner` row). One replica of `--ranks` gloo ranks, one process each, one torch
thread each, `charlm`. In the same processes and the same run, every rank alternates two kinds
of step on its own batches: a plain DDP step (its own copy of the model under its own DDP,
AdamW as DiLoCo's inner optimizer: zero_grad, forward, backward, step) and a Starling step
(rank 0: `Trainer.step` of `streaming-diloco`, alone in its swarm, with `sync_every` above the
run so no outer step falls in it; the other ranks: `ReplicaFollower.step`). Which of the two
goes first alternates every step. Rank 0's median wall time per step of each, after
`--warmup`, and every rank's ratio. Target: Starling's within 10% of plain DDP's on every rank
(ratio <= 1.10).

What an outer step costs inside the replica (`state_broadcast` row): rank 0 sends its
parameters, buffers and the swarm's model to the others after every write the others cannot
compute (an outer merge); the median time of that broadcast, and its bytes.

Outer-sync bytes (`bytes` row). A simulated swarm of 2 replicas of `--ranks` ranks against one
of 2 single-process peers, the same model, `streaming-diloco` options and `--sync-steps` steps:
the bytes each peer's node sent on protocol topics. Target: equal (ratio 1, up to message
headers that carry counters).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from step_compare import alternate, plain_step, run_ranks  # benchmarks/step_compare.py, beside this script
from torch.nn.parallel import DistributedDataParallel

from starling.node import Node
from starling.protocols.diloco_config import StreamingDiLoCoConfig
from starling.protocols.optim import make_optimizer
from starling.runtime import SimConfig, Simulation, Trainer, TrainSpec
from starling.runtime.replica import Replica, ReplicaFollower, ReplicaGroup, broadcast_tensors, state_tensors
from starling.tasks import get_task

TASK_OPTIONS = {"corpus_chars": 400_000}
SYNC_OPTIONS = {"sync_every": 4, "fragments": 2}
TARGET_STEP_RATIO = 1.10


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def _plain_ddp(task: Any, rank: int, world: int, seed: int) -> Any:
    """A DDP step over a fresh copy of the task's model, AdamW as DiLoCo's inner optimizer."""
    config = StreamingDiLoCoConfig()
    model = task.make_model()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], config.inner_optimizer,
                               config.lr, config.inner_momentum, config.weight_decay)
    return plain_step(task, ddp, optimizer, task.batches(rank, world, seed))


def _rank(rank: int, ranks: int, init: str, steps: int, warmup: int, out: Any) -> None:
    torch.set_num_threads(1)
    group = ReplicaGroup(rank, ranks, init, timeout_s=120.0)
    group.init()
    task = get_task("charlm", **TASK_OPTIONS)
    try:
        plain = _plain_ddp(task, *group.shard(1, 2), seed=0)  # another shard than Starling's: its own batches
        if rank == 0:
            node = Node().start("tcp://127.0.0.1:0", [], security="plaintext")
            spec = TrainSpec("streaming-diloco", "charlm", {"sync_every": 10 * (steps + warmup), "fragments": 2},
                             TASK_OPTIONS)
            trainer = Trainer(node, spec, 0, 2, task=task, serve_state=False, replication=Replica(group))
            trainer.create_protocol()
            trainer.lead_replica()
            batches = trainer.batches()

            def starling() -> None:
                trainer.step(next(batches))
        else:
            follower = ReplicaFollower(group)
            starling = follower.step  # type: ignore[assignment]
        times = alternate(("ddp", plain), ("starling", starling), steps, warmup)
        # what an outer merge costs inside the replica: the state broadcast
        model = trainer.proto.model if rank == 0 else follower.model  # type: ignore[union-attr]
        swarm = trainer.proto.eval_model() if rank == 0 else follower.swarm  # type: ignore[union-attr]
        tensors = state_tensors(model, swarm)
        broadcasts = []
        for _ in range(10):
            began = time.perf_counter()
            broadcast_tensors(tensors)
            broadcasts.append(time.perf_counter() - began)
        out.put({"rank": rank, "ddp": times["ddp"], "starling": times["starling"], "broadcast": broadcasts,
                 "broadcast_bytes": sum(t.numel() * t.element_size() for t in tensors),
                 "parameters": sum(p.numel() for p in model.parameters())})
        if rank == 0:
            trainer.finish_replica()
            node.close()
        else:
            follower.step()  # the STOP
    finally:
        group.close()


def inner_steps(ranks: int, steps: int, warmup: int) -> None:
    by_rank = run_ranks(_rank, ranks, steps, warmup)
    got = by_rank[0]
    ddp, starling = statistics.median(got["ddp"]), statistics.median(got["starling"])
    # every rank's ratio: a follower's step includes its wait for the leader's order
    ratios = {r: statistics.median(g["starling"]) / statistics.median(g["ddp"]) for r, g in sorted(by_rank.items())}
    worst = max(ratios.values())
    emit({"row": "inner", "ranks": ranks, "steps": steps, "parameters": got["parameters"],
          "ddp_step_ms": round(ddp * 1e3, 3), "starling_step_ms": round(starling * 1e3, 3),
          "ratio": round(starling / ddp, 4), "ratio_by_rank": [round(v, 4) for v in ratios.values()],
          "target": TARGET_STEP_RATIO, "met": worst <= TARGET_STEP_RATIO})
    emit({"row": "state_broadcast", "ranks": ranks, "bytes": got["broadcast_bytes"],
          "median_ms": round(statistics.median(got["broadcast"]) * 1e3, 3),
          "per_inner_step": round(statistics.median(got["broadcast"]) / ddp, 3)})


def outer_bytes(ranks: int, steps: int) -> None:
    common = {"peers": 2, "protocol": "streaming-diloco", "steps": steps, "options": SYNC_OPTIONS,
              "task_options": TASK_OPTIONS}
    replicas = Simulation(SimConfig(**common, nproc_per_replica=ranks)).run().summary
    single = Simulation(SimConfig(**common, transport="tcp", processes=2)).run().summary
    ratio = replicas["bytes_sent_per_peer"] / single["bytes_sent_per_peer"]
    emit({"row": "bytes", "ranks": ranks, "steps": steps, **SYNC_OPTIONS,
          "replica_bytes_sent": replicas["bytes_sent_per_peer"],
          "single_process_bytes_sent": single["bytes_sent_per_peer"],
          "ratio": round(ratio, 5), "met": abs(ratio - 1.0) <= 1e-3,
          "replica_eval_loss": replicas["eval_loss"], "single_process_eval_loss": single["eval_loss"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--sync-steps", type=int, default=24, help="steps of the outer-bytes runs")
    parser.add_argument("--only", choices=("inner", "bytes"))
    args = parser.parse_args()
    if args.only != "bytes":
        inner_steps(args.ranks, args.steps, args.warmup)
    if args.only != "inner":
        outer_bytes(args.ranks, args.sync_steps)


if __name__ == "__main__":
    main()
