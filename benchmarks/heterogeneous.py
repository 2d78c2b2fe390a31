"""Peers of different speeds: asynchronous Streaming DiLoCo against the protocols
that wait for the slowest peer, on the same wall-clock budget.

    python benchmarks/heterogeneous.py [--budget-s S] [--speeds 1,1,1,0.33] [--sync-every H]
                                       [--fragments F] [--overlap-steps T] [--equal-steps N]
                                       [--quorum K] [--grace-s G]

Every run is a simulated swarm of 4 real nodes on `charlm` over inproc sockets, one training
thread per peer; a peer of speed v sleeps (1/v - 1) times each step's compute on its training
thread (`SimConfig.peer_speed`). Each protocol trains for the same `--budget-s` seconds
(`SimConfig.duration_s`), then every peer evaluates the model it holds (DiLoCo: the outer
parameters, the same on every peer). Prints one JSON row per run, then a summary row.

- ``async``: streaming-diloco with time-based rounds (`sync_every_s`, sized to about
  `--sync-every` steps of a full-speed peer as measured in the equal-speed run), a quorum
  of `--quorum` peers plus `--grace-s`, token-weighted averages.
- ``sync``: streaming-diloco syncing every `--sync-every` steps: each round waits for the
  slow peer's part.
- ``allreduce``: data-parallel AdamW, every step waits for the slow peer.

Targets: async ends with a lower eval loss than both others; the fast peers'
training threads are busy >= 90% of their steps' wall time (sum of `compute_s` over sum of
`wall_s`); with equal speeds, async is within 1% of sync streaming-diloco's eval loss at equal
steps (`equal` row, `--equal-steps` each). Reported too: the slow peer's share of the tokens
(its steps over all steps: every batch has the same size) and of the weight (its mean share
of the averages it was in, 0 for a round that closed without it).
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from starling.node.swim import Liveness
from starling.runtime import SimConfig, Simulation, busy_share

LR = 3e-3  # AdamW, inner and all-reduce (TUNED_ADAMW_LR for charlm)
UTIL_TARGET, EQUAL_TARGET = 0.90, 0.01
# Bounds what a run's last steps can wait for a peer that has already finished its steps; the
# same for every protocol, and far above any round of a run where every peer is still training.
ROUND_TIMEOUT_S = 10.0
# A lenient failure detector: no peer dies here, and a starved 2-core box must not declare one dead.
BENCH_LIVENESS = Liveness(probe_interval_s=0.5, suspicion_base_s=60.0)


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def run(protocol: str, options: dict[str, Any], speeds: tuple[float, ...], *, budget_s: float = 0.0,
        steps: int = 10**6, seed: int = 0) -> Any:
    config = SimConfig(peers=len(speeds), protocol=protocol, task="charlm", steps=steps, seed=seed,
                       options={"lr": LR, "round_timeout_s": ROUND_TIMEOUT_S, **options}, peer_speed=speeds,
                       duration_s=budget_s, liveness=BENCH_LIVENESS)
    return Simulation(config).run()


def describe(label: str, result: Any, speeds: tuple[float, ...]) -> dict[str, Any]:
    """One run's row: eval loss, utilization of the full-speed peers, the slow peers' shares."""
    fast = [p for p in result.peers if speeds[p.rank] == max(speeds)]
    slow = [p for p in result.peers if speeds[p.rank] < max(speeds)]
    steps = {p.rank: len(p.records) for p in result.peers}
    total = sum(steps.values())

    def weight_share(p: Any) -> float:
        info = p.protocol_info or {}
        return float(info["mean_share"]) if "mean_share" in info else 1.0 / len(result.peers)

    return {
        "run": label, "protocol": result.config.protocol, "options": dict(result.config.options),
        "speeds": list(speeds), "budget_s": result.config.duration_s, "eval_loss": result.summary["eval_loss"],
        "steps": steps, "fast_utilization": busy_share(r for p in fast for r in p.records),
        "slow_token_share": sum(steps[p.rank] for p in slow) / total if slow else None,
        "slow_weight_share": sum(weight_share(p) for p in slow) if slow else None,
        "slow_missed_rounds": [int((p.protocol_info or {}).get("missed_rounds", 0)) for p in slow],
        "bytes_sent_per_peer": result.summary["bytes_sent_per_peer"], "wall_s": result.summary["wall_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=45.0, help="wall-clock seconds each protocol trains")
    parser.add_argument("--speeds", default="1,1,1,0.33")
    parser.add_argument("--sync-every", type=int, default=40, help="H: inner steps between syncs (sync run)")
    parser.add_argument("--fragments", type=int, default=4)
    # tau: the sync run's overlap, and the floor of the async run's, whose rounds merge after
    # the steps that fit in half a fragment's window if more (overlap_window_share)
    parser.add_argument("--overlap-steps", type=int, default=4)
    parser.add_argument("--equal-steps", type=int, default=200)
    parser.add_argument("--quorum", type=int, default=3)
    parser.add_argument("--grace-s", type=float, default=0.2)
    args = parser.parse_args()
    speeds = tuple(float(v) for v in args.speeds.split(","))
    equal = (1.0,) * len(speeds)
    sync_opts = {"sync_every": args.sync_every, "fragments": args.fragments, "overlap_steps": args.overlap_steps}

    # Equal speeds, equal steps: the sync run also times a full-speed step, which sizes the
    # async windows to about H steps.
    sync_equal = run("streaming-diloco", sync_opts, equal, steps=args.equal_steps)
    step_s = statistics.median(r["step_wall_s"] for p in sync_equal.peers for r in p.records[args.sync_every:])
    step_s = max(step_s, (sync_equal.summary["wall_s"]) / args.equal_steps)
    async_opts = {**sync_opts, "sync_every_s": round(args.sync_every * step_s, 3), "quorum": args.quorum,
                  "quorum_grace_s": args.grace_s}
    async_equal = run("streaming-diloco", async_opts, equal, steps=args.equal_steps)
    gap = async_equal.summary["eval_loss"] / sync_equal.summary["eval_loss"] - 1.0
    equal_row = {"run": "equal", "steps": args.equal_steps, "sync_eval_loss": sync_equal.summary["eval_loss"],
                 "async_eval_loss": async_equal.summary["eval_loss"], "relative_gap": gap,
                 "sync_every_s": async_opts["sync_every_s"], "measured_step_s": step_s,
                 "async_steps": {p.rank: len(p.records) for p in async_equal.peers}}
    emit(equal_row)

    rows = {}
    for label, protocol, options in (("async", "streaming-diloco", async_opts),
                                     ("sync", "streaming-diloco", sync_opts),
                                     ("allreduce", "allreduce", {"optimizer": "adamw"})):
        rows[label] = describe(label, run(protocol, options, speeds, budget_s=args.budget_s), speeds)
        emit(rows[label])

    best_other = min(rows["sync"]["eval_loss"], rows["allreduce"]["eval_loss"])
    emit({"run": "summary", "speeds": list(speeds), "budget_s": args.budget_s,
          "eval_loss": {k: r["eval_loss"] for k, r in rows.items()},
          "fast_utilization": {k: r["fast_utilization"] for k, r in rows.items()},
          "slow_token_share": rows["async"]["slow_token_share"],
          "slow_weight_share": rows["async"]["slow_weight_share"],
          "async_beats_both": rows["async"]["eval_loss"] < best_other,
          "async_utilization_met": rows["async"]["fast_utilization"] >= UTIL_TARGET,
          "equal_speed_gap": gap, "equal_speed_met": abs(gap) <= EQUAL_TARGET})


if __name__ == "__main__":
    main()
