"""A swarm stopped at step 300 and restarted from its checkpoints ends where an uninterrupted
run ends.

    python benchmarks/restart.py [--steps 600] [--stop-at 300] [--peers 4] [--quick]

Target: 4 peers on `charlm` with `streaming-diloco`, all stopped at step 300,
restarted from their checkpoints and run to step 600, end with the same eval loss as an
uninterrupted 600-step run; bit for bit where the run is deterministic, and reported either
way. Every run is a simulated swarm of real nodes over inproc sockets with seeded keys (the
simulator's default, so shard ownership and summation order repeat). The first leg writes
each peer's checkpoint at `--stop-at` and ends there (every node closes, as a killed swarm's
would: nothing but the checkpoints carries over); the second leg starts new nodes that load
them. The row also says how many Streaming DiLoCo rounds were in flight in the checkpoints:
those are the state a restart can get wrong.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from starling.runtime import CheckpointStore, SimConfig, Simulation


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--stop-at", type=int, default=300)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--protocol", default="streaming-diloco")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 peers, 24 steps, stop at 12, H = 8")
    args = parser.parse_args()
    options: dict[str, Any] = {}
    task_options: dict[str, Any] = {}
    if args.quick:
        args.peers, args.steps = 2, 24
        args.stop_at = args.stop_at if args.stop_at != 300 else 12
        options = {"sync_every": 8}
        task_options = {"n_layer": 1, "n_embd": 16, "n_head": 2, "seq_len": 16, "batch_size": 4,
                        "corpus_chars": 20_000, "eval_batches": 1}
    if not 0 < args.stop_at < args.steps:
        parser.error("--stop-at must be between 0 and --steps")

    def config(steps: int, **extra: Any) -> SimConfig:
        return SimConfig(peers=args.peers, protocol=args.protocol, task="charlm", steps=steps, seed=args.seed,
                         options=options, task_options=task_options, **extra)

    directory = Path(tempfile.mkdtemp(prefix="starling-restart-"))
    try:
        t = time.monotonic()
        whole = Simulation(config(args.steps)).run().summary
        whole_s = time.monotonic() - t
        t = time.monotonic()
        Simulation(config(args.stop_at, checkpoint_dir=str(directory), checkpoint_every=args.stop_at)).run()
        state = CheckpointStore(directory / "peer-0").load_latest()
        in_flight = len(state[1]["protocol"].get("in_flight", ())) if state else 0
        resumed = Simulation(config(args.steps, checkpoint_dir=str(directory), checkpoint_every=args.stop_at,
                                    resume=True)).run().summary
        legs_s = time.monotonic() - t
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    emit({"bench": "restart", "protocol": args.protocol, "peers": args.peers, "steps": args.steps,
          "stopped_at": args.stop_at, "rounds_in_flight_at_stop": in_flight,
          "eval_loss_uninterrupted": whole["eval_loss"], "eval_loss_restarted": resumed["eval_loss"],
          "difference": resumed["eval_loss"] - whole["eval_loss"],
          "bit_for_bit": resumed["eval_loss"] == whole["eval_loss"],
          "bytes_per_peer_uninterrupted": whole["bytes_sent_per_peer"],
          "wall_s_uninterrupted": round(whole_s, 1), "wall_s_two_legs": round(legs_s, 1),
          "met": resumed["eval_loss"] == whole["eval_loss"]})


if __name__ == "__main__":
    main()
