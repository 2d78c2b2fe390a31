"""Every rank syncs its own shard: FSDP2 inside a replica (gloo), one sub-swarm per shard rank.

The multi-process tests run `Simulation(nproc_per_replica=2, shard_sync=True)`: every rank a
process and a Starling peer of its own, rank k of each replica in sub-swarm k. Every rank
reports digests of its chunks of the model and of the swarm's model (the outer parameters).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_zygote import cli_popen

from starling.node import JoinError
from starling.runtime import SimConfig, Simulation, Trainer, TrainSpec, parse_churn
from starling.runtime.replica import REPLICA_RANKS_KEY, Replica, ReplicaError, ReplicaGroup
from starling.runtime.shard_sync import SHARD_RANK_KEY, ShardSync, check_shard_rank, fsdp_unavailable, local_chunk

TINY = {"corpus_chars": 60_000, "n_layer": 2, "n_embd": 32, "seq_len": 32, "batch_size": 8, "eval_batches": 1}
WORKER = Path(__file__).with_name("shard_worker.py")

pytestmark = pytest.mark.skipif(fsdp_unavailable() is not None, reason=f"FSDP2 on the CPU: {fsdp_unavailable()}")


def run(steps: int, churn: str = "", peers: int = 2, protocol: str = "streaming-diloco", **options):
    config = SimConfig(peers=peers, protocol=protocol, steps=steps, nproc_per_replica=2, shard_sync=True,
                       churn=parse_churn(churn) if churn else (), task_options=TINY,
                       options={"sync_every": 4, **({"fragments": 2} if protocol == "streaming-diloco" else {}),
                                **options})
    return {p.rank: p for p in Simulation(config).run().peers}


def ranks(peer) -> list[dict]:
    return peer.protocol_info["replica"]["digests"]


@pytest.mark.slow
def test_fsdp2_under_the_view_steps_as_plain_fsdp2_and_the_view_is_the_chunks(tmp_path):
    procs = [cli_popen([sys.executable, str(WORKER), str(rank), "2", str(tmp_path), str(tmp_path / f"{rank}")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out.decode()[-3000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"{rank}").read_text())
        assert report["tied_once"]  # tied embeddings: one parameter of the view, as of the model
        assert report["chunks_match"] and report["chunks_are_fsdp2s"]  # local_chunk is FSDP2's split
        assert report["changed"] and report["steps_match"]  # 3 AdamW steps bit for bit as plain FSDP2's
        assert report["view_aliases"]  # a write into the view is what the next all-gather sends
        assert report["agree_all"] and not report["agree_one_stops"]  # one rank stopping stops both
        assert report["all_min"] == [10, -11]  # the steps ranks 0 and 1 hold: from 10 to 11
        assert report["eval_sharded"] == report["eval_full"] and report["view_restored"]


def test_local_chunk_splits_dim0_as_torch_chunk_with_empty_tails():
    import torch

    t = torch.arange(10.0).reshape(5, 2)
    assert [local_chunk(t, r, 4).shape[0] for r in range(4)] == [2, 2, 1, 0]
    assert torch.equal(local_chunk(t, 2, 4), t[4:5])
    with pytest.raises(ValueError, match="scalar"):
        local_chunk(torch.tensor(1.0), 0, 2)


@pytest.mark.slow
def test_two_replicas_of_two_ranks_hold_identical_outer_chunks_rank_by_rank():
    peers = run(steps=12)
    assert [p.status for p in peers.values()] == ["finished", "finished"]
    a, b = ranks(peers[0]), ranks(peers[1])
    assert [d["rank"] for d in a] == [d["rank"] for d in b] == [0, 1]
    for k in range(2):  # rank k of both replicas averaged the same chunk in sub-swarm k
        assert a[k]["swarm"] == b[k]["swarm"]
        assert a[k]["model"] != b[k]["model"]  # the local chunks went their own ways since the last merge
    assert a[0]["swarm"] != a[1]["swarm"]  # each rank holds its own chunk, not the whole model
    for peer in peers.values():
        assert sum(r["synced"] for r in peer.records) >= 4  # its outer steps went through its sub-swarms
        sent = [d["bytes_sent"] for d in ranks(peer)]
        assert min(sent) > 0.8 * max(sent)  # the replica's outer-sync bytes leave through both ranks
        held = [d["held_bytes"] for d in ranks(peer)]
        assert held[0]["outer"] > 0 and held[0]["parameters"] <= held[0]["outer"] // 2 + 1024


@pytest.mark.slow
def test_sigkill_of_one_rank_takes_its_replica_out_of_every_sub_swarm():
    peers = run(steps=24, churn="kill:1@4", protocol="diloco")
    killed, survivor = peers[1], peers[0]
    assert killed.status == "killed" and "left its sub-swarm" in (killed.error or "")
    assert len(killed.records) < 24
    assert survivor.status == "finished" and len(survivor.records) == 24
    assert survivor.records[-1]["peers"] == 1  # sub-swarm 0: its last rounds without the replica
    assert [d["live_peers"] for d in ranks(survivor)] == [0, 0]  # and sub-swarm 1 too


@pytest.mark.slow
def test_a_replica_joins_each_sub_swarm_and_ends_with_the_same_outer_chunks():
    peers = run(steps=30, churn="join@4", protocol="diloco", check_every=1)
    assert [p.status for p in peers.values()] == ["finished"] * 3
    joiner = peers[2]
    assert joiner.joined_at_step > 0
    for k in range(2):
        assert len({ranks(p)[k]["swarm"] for p in peers.values()}) == 1


def test_a_peer_of_another_shard_rank_or_of_whole_models_is_refused(make_node):
    first = make_node(swarm_config={"protocol": "diloco", REPLICA_RANKS_KEY: 2, SHARD_RANK_KEY: 0})
    with pytest.raises(JoinError, match="shard_rank: swarm has 0, this node has 1"):
        make_node(join=[first.address], swarm_config={REPLICA_RANKS_KEY: 2, SHARD_RANK_KEY: 1})
    joiner = make_node(join=[first.address], swarm_config={REPLICA_RANKS_KEY: 2})  # said nothing of shards
    trainer = Trainer(joiner, TrainSpec("diloco", task_options=TINY), 0, 1,
                      replication=Replica(ReplicaGroup(0, 2, "env://")))
    with pytest.raises(ReplicaError, match="sub-swarm of shard rank 0.*--shard-sync"):
        trainer.create_protocol()
    assert trainer.proto is None
    check_shard_rank({}, None)
    with pytest.raises(ReplicaError, match="rank 1 of its replica, and a swarm of whole models"):
        check_shard_rank({}, 1)


def test_shard_sync_needs_a_protocol_of_local_inner_steps(make_node, tmp_path):
    node = make_node(swarm_config={"protocol": "allreduce"})
    group = ReplicaGroup(0, 1, f"file://{tmp_path}/rendezvous", timeout_s=10.0)
    trainer = Trainer(node, TrainSpec("allreduce", task_options=TINY), 0, 1, replication=ShardSync(group))
    with pytest.raises(Exception, match="cannot each sync their own shard"):
        trainer.create_protocol()
    with pytest.raises(ValueError, match="--nproc-per-replica 2 or more"):
        SimConfig(peers=2, protocol="diloco", steps=2, shard_sync=True)


def test_one_rank_group_trains_through_the_view_and_evaluates(make_node, tmp_path):
    """A replica of one rank under shard sync: FSDP2 over one process, the whole Trainer path."""
    node = make_node(swarm_config={"protocol": "diloco"})
    group = ReplicaGroup(0, 1, f"file://{tmp_path}/rendezvous", timeout_s=10.0)
    group.init()
    try:
        trainer = Trainer(node, TrainSpec("diloco", task_options=TINY, options={"sync_every": 2}), 0, 1,
                          replication=ShardSync(group))
        trainer.create_protocol()
        assert node.swarm_config[SHARD_RANK_KEY] == 0
        before = trainer.evaluate()["eval_loss"]
        import threading

        assert trainer.run(4, threading.Event()) == 4
        assert trainer.proto.step_count == 4 and trainer.evaluate()["eval_loss"] < before
    finally:
        group.close()


def test_a_replicas_rank_records_are_taken_only_as_their_ranks_signed_them():
    import dataclasses

    import msgpack

    from starling.node.identity import Identity
    from starling.node.membership import PeerRecord
    from starling.runtime.shard_sync import parse_rank_records

    records = [PeerRecord.create(Identity.generate(), [f"tcp://127.0.0.1:{4000 + k}"], 1) for k in range(2)]
    blob = msgpack.packb([r.to_wire() for r in records], use_bin_type=True)
    assert parse_rank_records(blob, 2) == [("tcp://127.0.0.1:4000",), ("tcp://127.0.0.1:4001",)]
    assert parse_rank_records(msgpack.packb([records[0].to_wire(), None]), 2) == [("tcp://127.0.0.1:4000",), ()]
    forged = dataclasses.replace(records[1], addresses=("tcp://10.0.0.9:4001",))  # rank 0 naming another address
    for bad, why in ((msgpack.packb([records[0].to_wire(), forged.to_wire()]), "signature"),
                     (blob, "records of 3 ranks"), (b"\xc1", "not msgpack"),
                     (msgpack.packb([records[0].to_wire(), [1, 2]]), "7-item list")):
        with pytest.raises(ValueError, match=why):
            parse_rank_records(bad, 3 if why == "records of 3 ranks" else 2)


def _ranks_run(tmp_path, name: str, size: int, steps: int) -> list[dict]:
    """`size` ranks of shard_worker.py's checkpoint mode; each rank's saved chunks, by rank."""
    import torch

    rendezvous = tmp_path / f"rv-{name}"
    rendezvous.mkdir()
    outs = [tmp_path / f"{name}-{rank}.pt" for rank in range(size)]
    procs = [cli_popen([sys.executable, str(WORKER), "checkpoint", str(rank), str(size), str(rendezvous),
                        str(tmp_path / "ckpt"), str(outs[rank]), str(steps)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(size)]
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out.decode()[-3000:]
    return [torch.load(o, weights_only=True) for o in outs]


def _whole(ranks: list[dict], key: str) -> list:
    """Each parameter's tensor of `key`, put back together from the ranks' dim-0 chunks."""
    import torch

    return [torch.cat([r[key][i] for r in ranks]) for i in range(len(ranks[0][key]))]


@pytest.mark.slow
def test_a_replicas_checkpoint_resumes_on_another_rank_count(tmp_path):
    import torch

    written = _ranks_run(tmp_path, "two", 2, steps=8)  # checkpoints at 4 and 8
    assert written[0]["resumed"] is None and written[0]["step"] == 8
    # read back by three ranks (chunks of other bounds), before any step (steps=8: none left)
    read = _ranks_run(tmp_path, "three", 3, steps=8)
    assert all(r["resumed"] == 8 and r["step"] == 8 and r["versions"] == written[0]["versions"] for r in read)
    for key in ("model", "outer", "momentum", "exp_avg"):
        for a, b in zip(_whole(written, key), _whole(read, key)):
            assert torch.equal(a, b), key
    assert read[0]["adam_step"] == written[0]["adam_step"]
    assert any(not torch.equal(a, b) for a, b in zip(_whole(written, "outer"), _whole(written, "model")))
    # and it trains on from there, one rank holding what two did, and checkpoints again
    (on,) = _ranks_run(tmp_path, "on", 1, steps=12)
    assert on["resumed"] == 8 and on["step"] == 12
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[-2:] == ["step-000000012.dcp", "step-000000012.json"]
