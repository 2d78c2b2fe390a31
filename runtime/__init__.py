"""starling.runtime: running a training job.

`TrainSpec` and `Trainer` run one peer (`starling node start`), `NodeLaunch` says what that
peer asks of its swarm (what a first node fixes, what a joiner insists on), and `PeerRun`
runs it once its node is up (where it starts from, checkpoints, progress records); its
`Replication` says how the peer's model is held by its processes (`launch_replica` makes one
for a process: one process, a replica under DDP or under FSDP2). The
simulator runs many (`Simulation(SimConfig(...)).run()`), in threads or spread over worker
processes, with churn and emulated links, and sums the run up; `SimConfig.baseline()` is the
run to compare with. `protocol_config` is the one reading of protocol options into the
protocol's config.
"""
from __future__ import annotations

from starling.runtime.checkpoint import BackgroundCheckpointer, Checkpoint, CheckpointError, CheckpointStore
from starling.runtime.churn import ChurnEvent, ChurnSpecError, check_churn, parse_churn
from starling.runtime.launch import NodeLaunch, newest_checkpoint_spec
from starling.runtime.links import LinkEmulator, LinkModel, RateError, format_rate, parse_rate
from starling.runtime.peer import SimPeer
from starling.runtime.peer_run import PeerRun
from starling.runtime.replica_launch import ReplicaLaunch, launch_replica
from starling.runtime.replication import Replication, Single
from starling.runtime.sim import Simulation
from starling.runtime.simconfig import (
    SIM_LIVENESS,
    TRANSPORTS,
    SimConfig,
    SimError,
    check_config,
    endpoint_for,
    seeded_identity,
    wait_for,
)
from starling.runtime.summary import (
    PeerResult,
    SimResult,
    busy_note,
    busy_share,
    liveness_note,
    spsa_bytes_note,
    summarize,
)
from starling.runtime.trainer import (
    CheckpointConfig,
    Trainer,
    TrainSpec,
    TrainSpecError,
    prepare_to_train,
    protocol_config,
    resolve_protocol,
    shard_for,
    with_run_length,
)

__all__ = [
    "SIM_LIVENESS",
    "TRANSPORTS",
    "BackgroundCheckpointer",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointStore",
    "ChurnEvent",
    "ChurnSpecError",
    "LinkEmulator",
    "LinkModel",
    "NodeLaunch",
    "PeerResult",
    "PeerRun",
    "RateError",
    "ReplicaLaunch",
    "Replication",
    "SimConfig",
    "SimError",
    "SimPeer",
    "SimResult",
    "Simulation",
    "Single",
    "TrainSpec",
    "TrainSpecError",
    "Trainer",
    "busy_note",
    "busy_share",
    "check_churn",
    "check_config",
    "endpoint_for",
    "format_rate",
    "launch_replica",
    "liveness_note",
    "newest_checkpoint_spec",
    "parse_churn",
    "parse_rate",
    "prepare_to_train",
    "protocol_config",
    "resolve_protocol",
    "seeded_identity",
    "shard_for",
    "spsa_bytes_note",
    "summarize",
    "wait_for",
    "with_run_length",
]
