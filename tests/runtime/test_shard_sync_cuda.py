"""`--shard-sync`'s FSDP2 path on a GPU (NCCL): skipped without CUDA, run by benchmarks/gpu_check.sh."""
from __future__ import annotations

import threading

import pytest
import torch

from starling.runtime import Trainer, TrainSpec
from starling.runtime.placement import Placement
from starling.runtime.replica import ReplicaGroup
from starling.runtime.shard_sync import ShardSync

TINY = {"corpus_chars": 60_000, "n_layer": 2, "n_embd": 32, "seq_len": 32, "batch_size": 8, "eval_batches": 1}

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_one_rank_nccl_replica_trains_its_view_on_the_gpu_and_evaluates(make_node, tmp_path):
    node = make_node(swarm_config={"protocol": "diloco"})
    group = ReplicaGroup(0, 1, f"file://{tmp_path}/rendezvous", timeout_s=30.0, backend="nccl", local_rank=0)
    group.init()
    try:
        trainer = Trainer(node, TrainSpec("diloco", task_options=TINY, options={"sync_every": 2}), 0, 1,
                          placement=Placement(device=torch.device("cuda")), replication=ShardSync(group))
        trainer.create_protocol()
        views = [v for _, v in trainer.replication.sharded.pairs]
        assert all(v.device.type == "cuda" for v in views)
        first = [p.to_local() for p, _ in trainer.replication.sharded.pairs]
        assert all(v.data_ptr() == f.data_ptr() for v, f in zip(views, first))  # the view aliases the chunks
        before = trainer.evaluate()["eval_loss"]
        assert trainer.run(4, threading.Event()) == 4
        assert trainer.evaluate()["eval_loss"] < before
    finally:
        group.close()
