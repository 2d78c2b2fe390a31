"""One rank of a 2-rank gloo group for tests/runtime/test_shard_sync.py: the same model
trained by plain FSDP2 and by `ShardedModel` (the protocol's view of this rank's chunks),
compared step by step. Usage: shard_worker.py RANK SIZE RENDEZVOUS_DIR OUT_JSON; or
shard_worker.py checkpoint RANK SIZE RENDEZVOUS_DIR CHECKPOINT_DIR OUT STEPS: train STEPS steps
of streaming-diloco alone with a distributed checkpoint every 4 (after resuming from the
newest one, whatever rank count wrote it) and save this rank's chunks of everything to OUT."""
from __future__ import annotations

import json
import os
import sys

import torch

from starling.protocols.optim import make_optimizer
from starling.runtime.replica import ReplicaGroup
from starling.runtime.shard_sync import ShardedModel, ShardSync, local_chunk, shard_units
from starling.tasks import get_task

TINY = {"corpus_chars": 60_000, "n_layer": 2, "n_embd": 32, "seq_len": 32, "batch_size": 4, "eval_batches": 1}


def main(rank: int, size: int, directory: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    group = ReplicaGroup(rank, size, f"file://{directory}/rendezvous", timeout_s=60.0)
    group.init()
    task = get_task("charlm", **TINY)
    full = task.make_model()
    plain = task.make_model()
    sharded = ShardedModel(task.make_model(), group)
    for unit in shard_units(plain):
        fully_shard(unit, mesh=sharded.mesh)
    fully_shard(plain, mesh=sharded.mesh)
    report: dict = {}
    views = list(sharded.view.parameters())
    report["tied_once"] = len(views) == len(list(full.parameters()))
    report["chunks_match"] = all(torch.equal(v, local_chunk(p.detach(), rank, size))
                                 for v, p in zip(views, full.parameters()))
    report["chunks_are_fsdp2s"] = all(torch.equal(v, p.to_local()) for v, p in zip(views, plain.parameters()))
    plain_opt = make_optimizer(list(plain.parameters()), "adamw", 0.01, 0.0, 0.01)
    view_opt = make_optimizer(views, "adamw", 0.01, 0.0, 0.01)
    sharded.attach(view_opt)
    batches = task.batches(rank, size, 0)
    for _ in range(3):
        batch = next(batches)
        plain_opt.zero_grad(set_to_none=True)
        task.loss(plain, batch).backward()
        plain_opt.step()
        view_opt.zero_grad(set_to_none=False)
        task.loss(sharded.module, batch).backward()
        view_opt.step()
    report["steps_match"] = all(torch.equal(v, p.to_local()) for v, p in zip(views, plain.parameters()))
    report["changed"] = not all(torch.equal(v, local_chunk(p.detach(), rank, size))
                                for v, p in zip(views, full.parameters()))
    with torch.no_grad():  # a write into the view is what the next all-gather sends
        views[0].add_(1.0)
    gathered = next(sharded.module.parameters()).full_tensor()
    report["view_aliases"] = bool(torch.equal(local_chunk(gathered, rank, size), views[0]))
    report["agree_all"] = sharded.agree(True)
    report["agree_one_stops"] = sharded.agree(rank != 1)
    report["all_min"] = list(sharded.all_min(10 + rank, -(10 + rank)))  # least, and minus the greatest
    swarm = sharded.view_of(full)  # evaluate the initial model, sharded
    report["eval_sharded"] = sharded.evaluate(task, swarm)["eval_loss"]
    report["eval_full"] = task.evaluate(full)["eval_loss"]
    report["view_restored"] = bool(torch.equal(local_chunk(next(sharded.module.parameters()).full_tensor(), rank,
                                                           size), views[0]))
    group.close()
    with open(out, "w") as f:
        json.dump(report, f)


def checkpoint(rank: int, size: int, directory: str, checkpoints: str, out: str, steps: int) -> None:
    import threading

    from starling.node import Node
    from starling.runtime.trainer import CheckpointConfig, Trainer, TrainSpec

    torch.set_num_threads(1)
    group = ReplicaGroup(rank, size, f"file://{directory}/rendezvous", timeout_s=60.0)
    group.init()
    node = Node().start("tcp://127.0.0.1:0", [], security="plaintext")
    spec = TrainSpec("streaming-diloco", "charlm", {"sync_every": 2, "fragments": 2}, TINY)
    replication = ShardSync(group)  # rank `rank` of the peer's one shard: data shard rank of size
    trainer = Trainer(node, spec, 0, 1, serve_state=False, replication=replication,
                      checkpoint=CheckpointConfig(checkpoints, every=4))
    proto = trainer.create_protocol()
    resumed = trainer.resume_replica()
    trainer.run(steps, threading.Event())
    store = replication.checkpoints
    held = proto.outer_state()
    torch.save({"resumed": resumed, "step": proto.step_count, "versions": list(held.versions),
                "model": [v.detach().clone() for _, v in replication.sharded.pairs],
                "outer": store._per_parameter(held, held.outer),
                "momentum": store._per_parameter(held, held.momentum),
                "exp_avg": [proto.optimizer.state[v]["exp_avg"].clone() for _, v in replication.sharded.pairs],
                "adam_step": [float(proto.optimizer.state[v]["step"]) for _, v in replication.sharded.pairs]}, out)
    node.close()
    group.close()


if __name__ == "__main__":
    if sys.argv[1] == "checkpoint":
        checkpoint(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], int(sys.argv[7]))
    else:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    # gloo's threads can abort the interpreter's teardown after FSDP2 (std::terminate); the
    # report is written, so leave as multiprocessing's children do
    sys.stdout.flush()
    os._exit(0)
