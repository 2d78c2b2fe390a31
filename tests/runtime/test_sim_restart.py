"""A simulated swarm stopped with Streaming DiLoCo rounds in flight and restarted from its
checkpoints ends bit for bit where an uninterrupted run ends."""
from __future__ import annotations

import io

import pytest
import torch
from conftest import swarm

from starling.protocols import PRIVATE_STATE
from starling.runtime import CheckpointStore, SimConfig, Simulation, Trainer, TrainSpec

TINY = {"n_layer": 1, "n_embd": 16, "n_head": 2, "seq_len": 16, "batch_size": 4, "corpus_chars": 20_000,
        "eval_batches": 1}


def _config(steps: int, **extra) -> SimConfig:
    return SimConfig(peers=2, protocol="streaming-diloco", task="charlm", steps=steps, task_options=TINY,
                     options={"sync_every": 8}, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [12, 13])  # 13: a fragment's round is in flight
def test_a_restart_from_checkpoints_is_bit_for_bit(tmp_path, stop_at):
    whole = Simulation(_config(24)).run().summary
    Simulation(_config(stop_at, checkpoint_dir=str(tmp_path), checkpoint_every=stop_at)).run()
    _, state = CheckpointStore(tmp_path / "peer-0").load_latest()
    assert len(state["protocol"]["in_flight"]) == (1 if stop_at == 13 else 0)
    assert PRIVATE_STATE in state["protocol"]  # the residuals travel with the peer's own checkpoint
    resumed = Simulation(_config(24, checkpoint_dir=str(tmp_path), checkpoint_every=stop_at, resume=True)).run()
    assert resumed.summary["eval_loss"] == whole["eval_loss"]
    assert all(p.records[0]["step"] == stop_at for p in resumed.peers)  # both went on from the checkpoint


def test_a_joiners_snapshot_leaves_the_private_residuals_out(make_node):
    nodes = swarm(make_node, 2)
    spec = TrainSpec(protocol="streaming-diloco", task="quadratic", options={"sync_every": 4})
    trainer = Trainer(nodes[0], spec, rank=0, world=2)
    proto = trainer.create_protocol()
    assert PRIVATE_STATE in proto.state_dict()
    served = torch.load(io.BytesIO(trainer._snapshot), weights_only=True)
    assert PRIVATE_STATE not in served and served["step"] == 0
    trainer.close()


def test_resume_needs_a_checkpoint_dir():
    with pytest.raises(ValueError, match="resume needs a checkpoint_dir"):
        SimConfig(resume=True)
