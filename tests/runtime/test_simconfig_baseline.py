"""SimConfig.baseline(): the fair run to compare with, and protocol_config(), the one reading of
a run's protocol options."""
from __future__ import annotations

import pytest

from starling.protocols import ProtocolError
from starling.runtime import SimConfig, protocol_config


def test_the_baseline_trains_with_the_runs_optimizer_and_lr_and_without_its_compressor(tmp_path):
    run = SimConfig(peers=2, protocol="streaming-diloco", task="quadratic", steps=10, compressor="int8",
                    options={"sync-every": "8", "inner_optimizer": "adamw", "lr": "0.01", "outer_lr": "0.5"},
                    checkpoint_dir=str(tmp_path))
    base = run.baseline()
    assert base.protocol == "allreduce" and base.compressor is None
    # what allreduce knows of the run's options, its inner optimizer and lr; not sync_every or outer_lr
    assert dict(base.options) == {"lr": "0.01", "optimizer": "adamw"}
    assert (base.peers, base.task, base.steps, base.seed) == (run.peers, run.task, run.steps, run.seed)
    assert base.checkpoint_dir == str(tmp_path / "baseline")


def test_the_baseline_takes_the_runs_defaults_when_the_run_names_none():
    run = SimConfig(peers=2, protocol="diloco", task="quadratic", steps=10)
    config = run.protocol_config()
    assert dict(run.baseline().options) == {"optimizer": config.inner_optimizer, "lr": config.lr}
    assert run.optimizer() == config.inner_optimizer


def test_a_baseline_that_cannot_run_in_replicas_runs_single_process_peers():
    run = SimConfig(peers=2, protocol="diloco", task="quadratic", steps=10, nproc_per_replica=2)
    assert run.baseline().nproc_per_replica == 1
    assert run.baseline("streaming-diloco").nproc_per_replica == 2


def test_an_unknown_baseline_is_refused():
    with pytest.raises(ProtocolError, match="unknown protocol"):
        SimConfig(peers=2, task="quadratic", steps=10).baseline("nosuch")


def test_protocol_config_reads_text_and_dashes_as_the_protocol_does():
    config = protocol_config("gossip", {"fanout": "2", "lr": 0.1})
    assert (config.fanout, config.lr) == (2, 0.1)
    with pytest.raises(ProtocolError, match="fanout"):
        protocol_config("gossip", {"fanout": "two"})
    run = SimConfig(peers=2, protocol="sketch-dp", task="quadratic", steps=30, compressor=None)
    assert run.protocol_config().budget_steps == 30  # the run's length, for a protocol that plans over it
