"""How long a SIGKILLed peer stalls the survivors' training, with crash detection from the
dropped connection against heartbeats alone, in the same run.

    python benchmarks/crash.py [--peers 4] [--protocols allreduce,streaming-diloco] [--quick]

Target: a SIGKILLed peer process stalls the survivors by at most 1.5 s, for `allreduce` and
`streaming-diloco` (heartbeats alone take their dead timeout, 10 s).

Each case starts `--peers` real `starling node start` processes on loopback tcp with the
CLI's default liveness (heartbeat 1 s, suspect 3 s, dead 10 s, probe 1 s), training the
`quadratic` task with one JSON progress line per step. Once every peer has trained a while,
one (not the first) is SIGKILLed. A survivor's stall is the longest gap between two of its
progress lines in the 30 s after the kill, less its median gap before the kill (a step's own
time); the row reports the worst survivor. `heartbeats` runs the same case with
`--no-watch-connections`: only missed heartbeats reveal the crash.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nodeprocs import NodeProcess  # a sibling script module (benchmarks/ is not a package)

OPTIONS = {
    "allreduce": ["--lr", "0.05"],
    "streaming-diloco": ["--sync-every", "8", "--fragments", "2", "--overlap-steps", "1"],
}


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def run_case(protocol: str, peers: int, watch: bool, warmup_s: float, after_s: float,
             log_dir: str | None = None) -> dict[str, Any]:
    common = ["--plaintext", "--log-every", "1", "--log-level", "info" if log_dir else "warning"]
    if not watch:
        common.append("--no-watch-connections")
    def log(i: int) -> str | None:
        return os.path.join(log_dir, f"{protocol}-{'connections' if watch else 'heartbeats'}-{i}.log") \
            if log_dir else None

    first = NodeProcess([*common, "--protocol", protocol, "--task", "quadratic", "--task-opt", "dim=2000",
                         "--round-timeout-s", "30", *OPTIONS[protocol]], log(0))
    procs = [first]
    try:
        address = first.wait_for_address()
        procs += [NodeProcess([*common, "--join", address], log(i)) for i in range(1, peers)]
        for p in procs:
            p.wait_for_address()
        deadline = time.monotonic() + 180
        while not all(len(p.steps) > 20 for p in procs):  # every peer is training
            if time.monotonic() > deadline:
                raise RuntimeError("the swarm did not start training")
            time.sleep(0.1)
        time.sleep(warmup_s)
        victim = procs[-1]
        killed_at = time.monotonic()
        victim.kill()
        time.sleep(after_s)
        end = time.monotonic()
        stalls = []
        for p in procs[:-1]:
            steps = [(s.at, s.step) for s in p.steps]
            before = [b - a for (a, _), (b, _) in itertools.pairwise(steps) if b < killed_at]
            # the end of the window counts as a step: a survivor that never stepped again
            # stalled at least until then (the row then says "censored")
            after = [t for t, _ in steps if t >= killed_at - 1.0] + [end]
            gaps = [b - a for a, b in itertools.pairwise(after)]
            stalls.append(max(gaps) - statistics.median(before[-50:]))
        stepped = min(sum(1 for s in p.steps if s.at > killed_at) for p in procs[:-1])
        return {"stall_s": round(max(stalls), 3), "survivor_stalls_s": [round(s, 3) for s in stalls],
                "steps_after_kill": stepped, "censored": stepped == 0}
    finally:
        for p in procs:
            p.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--protocols", default="allreduce,streaming-diloco")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--after-s", type=float, default=15.0, help="watch the survivors this long after the kill")
    parser.add_argument("--quick", action="store_true", help="3 peers, allreduce")
    parser.add_argument("--log-dir", help="write each node's log (level info) here")
    args = parser.parse_args()
    protocols = ["allreduce"] if args.quick else args.protocols.split(",")
    peers = 3 if args.quick else args.peers
    for protocol in protocols:
        row: dict[str, Any] = {"protocol": protocol, "peers": peers}
        for label, watch in (("heartbeats", False), ("connections", True)):
            row[label] = run_case(protocol, peers, watch, args.warmup_s, args.after_s, args.log_dir)
        row["stall_ratio"] = round(row["connections"]["stall_s"] / max(row["heartbeats"]["stall_s"], 1e-9), 3)
        row["target_met"] = row["connections"]["stall_s"] <= 1.5
        emit(row)


if __name__ == "__main__":
    main()
