"""What the drift guard (`check_every`) costs in bytes and time: each protocol's swarm run twice,
with the guard off and on, the same seed, the same steps. With the guard on, every part also
names a sampled digest of its author's state (the check that follows a round begun apart), so
"on" includes that too; `time_ratio` is the runs' wall time on over off (the box's noise
included: read it over several runs).

    python benchmarks/drift_guard.py [--peers P] [--diloco-check-every K] [--check-every K]
                                     [--sync-every H] [--fragments F] [--steps N]
                                     [--only diloco,streaming-diloco,allreduce,sketch-dp]

In allreduce and sketch-dp a due round that was whole is the check (its parts name a digest
of every value): it costs no bytes beyond the digest every part names. Otherwise, and in
DiLoCo, a check is one tiny lossless round (32 float32 values to one owner and its average
back; nearly all of it is headers). DiLoCo checks every K syncs of fragment 0, so a run of
K * H steps holds exactly one check (round 0 of fragment 0) and K syncs of every fragment: its
ratio is the long-run one, whatever H (a fragment's bytes per sync do not depend on H, so the
default H = 8 only keeps the run short). allreduce and sketch-dp check every K steps
(rounds), and step 0 is checked, so a run of K steps holds one check. Runs train the same
bits both times (seeded keys, member-order sums), so `on - off` is the guard's bytes, give or
take a few dozen bytes of headers; the bytes on the guard's own topics (`*.agree`, and
`*.digest` and `*.sync` when the peers differ: none here, every peer starts from the same
weights) are printed too.
Bytes are per peer, the protocol's topics (requests and replies, headers included), membership
traffic left out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from starling.node.swim import Liveness
from starling.runtime import SimConfig, Simulation

# No peer dies in these runs; a lenient detector keeps a starved 2-core box from declaring one dead.
BENCH_LIVENESS = Liveness(probe_interval_s=0.5, suspicion_base_s=60.0)
TASKS = {"diloco": "charlm", "streaming-diloco": "charlm", "allreduce": "charlm", "sketch-dp": "teacher"}


def run(protocol: str, peers: int, steps: int, options: dict[str, Any]) -> dict[str, float]:
    config = SimConfig(peers=peers, protocol=protocol, task=TASKS[protocol], steps=steps, options=options,
                       liveness=BENCH_LIVENESS)
    began = time.perf_counter()
    result = Simulation(config).run()
    wall_s = time.perf_counter() - began
    failed = [p for p in result.peers if p.status != "finished"]
    if failed:
        raise RuntimeError(f"peer {failed[0].rank} {failed[0].status}: {failed[0].error}")
    topics = [p.records[-1]["bytes_by_topic"] for p in result.peers]
    guard = [sum(n for t, n in by.items() if t.endswith((".agree", ".digest", ".sync")) and "buffers" not in t)
             for by in topics]
    return {"bytes_per_peer": statistics.fmean(p.bytes_sent for p in result.peers),
            "guard_bytes_per_peer": statistics.fmean(guard), "wall_s": wall_s}


def measure(protocol: str, peers: int, steps: int, options: dict[str, Any], check_every: int) -> dict[str, Any]:
    off = run(protocol, peers, steps, {**options, "check_every": 0})
    on = run(protocol, peers, steps, {**options, "check_every": check_every})
    row = {"bench": "drift_guard", "protocol": protocol, "peers": peers, "steps": steps, **options,
           "check_every": check_every, "bytes_per_peer_off": off["bytes_per_peer"],
           "bytes_per_peer_on": on["bytes_per_peer"], "guard_bytes_per_peer": on["guard_bytes_per_peer"],
           "overhead": on["bytes_per_peer"] / off["bytes_per_peer"] - 1.0,
           "wall_s_off": round(off["wall_s"], 2), "wall_s_on": round(on["wall_s"], 2),
           "time_ratio": round(on["wall_s"] / off["wall_s"], 3)}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--diloco-check-every", type=int, default=10, help="syncs of fragment 0 between checks")
    parser.add_argument("--check-every", type=int, default=100, help="allreduce and sketch-dp: steps between checks")
    parser.add_argument("--sync-every", type=int, default=8, help="DiLoCo's H (the ratio does not depend on it)")
    parser.add_argument("--fragments", type=int, default=4, help="streaming-diloco's F")
    parser.add_argument("--steps", type=int, default=None, help="override the runs' length (default: one check)")
    parser.add_argument("--only", default="diloco,streaming-diloco,allreduce,sketch-dp")
    args = parser.parse_args(argv)
    rows = []
    for protocol in args.only.split(","):
        if protocol.endswith("diloco"):
            fragments = args.fragments if protocol == "streaming-diloco" else 1
            options = {"sync_every": args.sync_every, "fragments": fragments, "compressor": "int4"}
            steps = args.steps or args.diloco_check_every * args.sync_every
            rows.append(measure(protocol, args.peers, steps, options, args.diloco_check_every))
        else:
            rows.append(measure(protocol, args.peers, args.steps or args.check_every, {}, args.check_every))
    print(json.dumps({"bench": "summary", "max_overhead": max(r["overhead"] for r in rows),
                      "met": all(r["overhead"] < 0.005 for r in rows)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
