"""Several `starling node start` processes on one box: CPU spent with torch's default OpenMP
threads (one per core) against one thread each, for the same training.

    python benchmarks/node_threads.py [--peers 4] [--steps 32] [--repeats 2] [--quick]

Target: none; the row backs the advice in docs/operations.md ("Several CPU peers on one
machine"). Each run starts `--peers` real node processes on loopback (all-reduce, `charlm`,
`--steps` steps, the first node joined by the others), waits for every `stopped` line, and
reads the CPU the processes used (user + system, from `RUSAGE_CHILDREN`) and the wall time.
The two settings alternate, so a noisy box loads both alike; the ratio is default over one
thread, per pair of runs, and the eval losses show the training was the same.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from nodeprocs import NodeProcess, children_cpu_s, kill_all

FAST = ["--probe-interval-s", "0.3", "--suspicion-s", "6", "--log-level", "warning",
        "--plaintext"]


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)



def run(peers: int, steps: int, threads: int | None, timeout_s: float) -> dict[str, Any]:
    """One swarm of `peers` processes to `steps` steps: CPU seconds, wall seconds, eval losses."""
    train = ["--protocol", "allreduce", "--task", "charlm", "--steps", str(steps), "--log-every", str(steps),
             "--min-peers", str(peers), "--round-timeout-s", "10"]
    cpu0, wall0 = children_cpu_s(), time.monotonic()
    nodes: list[NodeProcess] = []
    try:
        for i in range(peers):
            join = ["--join", nodes[0].wait_for_address()] if nodes else []
            nodes.append(NodeProcess([*FAST, "--listen", "tcp://127.0.0.1:0", "--shard", f"{i}/{peers}", *train,
                                      *join], threads=threads))
        for node in nodes:
            if node.wait(timeout_s) != 0 or node.stopped is None:
                raise RuntimeError(f"a peer did not finish (exit status {node.proc.poll()})")
    finally:
        for node in nodes:
            node.close()
    return {"cpu_s": round(children_cpu_s() - cpu0, 2), "wall_s": round(time.monotonic() - wall0, 2),
            "eval_loss": sorted({round(float(n.stopped["eval_loss"]), 6) for n in nodes if n.stopped})}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (default threads, one thread)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 peers, 4 steps, one pair")
    args = parser.parse_args(argv)
    if args.quick:
        args.peers, args.steps, args.repeats = 2, 4, 1
    if args.peers < 2 or args.steps < 1 or args.repeats < 1:
        parser.error("--peers must be >= 2, --steps and --repeats >= 1")
    ratios = []
    try:
        for i in range(args.repeats):
            default = run(args.peers, args.steps, None, args.timeout_s)
            single = run(args.peers, args.steps, 1, args.timeout_s)
            ratios.append(default["cpu_s"] / single["cpu_s"])
            emit({"row": "pair", "repeat": i, "peers": args.peers, "steps": args.steps,
                  "default_threads": default, "one_thread": single, "cpu_ratio": round(ratios[-1], 2)})
    finally:
        kill_all()
    emit({"row": "summary", "peers": args.peers, "steps": args.steps,
          "cpu_ratio_median": round(statistics.median(ratios), 2),
          "what": "CPU seconds of the node processes with torch's default threads over one thread each"})


if __name__ == "__main__":
    main()
