"""A thousand peers on one box: start-up time and memory of simulated swarms.

    python benchmarks/scale.py [--sizes 128,256,512,1024] [--processes 0,4] [--steps 5]
                               [--protocol gossip] [--task quadratic] [--timeout-s 900]
                               [--max-dealers N]

Each row is one `Simulation` of `--peers N` gossip peers on `quadratic`, run in a fresh
interpreter, threads only (`--processes 0`) or sharded over P worker processes, with the
simulator's defaults for everything that depends on the swarm's size (the socket cap: over tcp
the largest that fits the descriptors and keeps the swarm's connections in budget,
`runtime.capacity.default_cap`, or `--max-dealers`; the heartbeat sized to the swarm; both are
in the row). Reported per row:
- start_s: from `Simulation.run()` to the first training step (every peer joined and sees
  every other), after torch's one-time lazy imports (`prepare_to_train`), which every
  process pays once whatever its size;
- tail_s: from the last progress report (every peer done) to the summary: the peers' results
  gathered and their nodes closed;
- total_s: the whole run, summary included; ok: it printed a summary;
- peak_rss_mb: the largest sum of resident memory over the run's process tree, sampled
  every 0.25 s from /proc;
- mb_per_peer: peak_rss_mb / N, and mb_per_peer_beyond_base: (peak - the same run's
  footprint at 8 peers) / (N - 8), the memory a peer adds beyond the interpreter, torch and
  the task (the model is 1000 floats).
Targets: 1024 threads-only peers start, train 5 steps and print a summary within 600 s on 2
cores; mb_per_peer_beyond_base under 2. Prints one JSON row per run, and a last row with the
start-up growth from the smallest size to each larger one (linear: growth == size ratio).
Run one benchmark at a time on a 2-core box: this one uses both cores for minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

CHILD = textwrap.dedent("""
    import json, sys, time
    from starling.runtime import SimConfig, Simulation, prepare_to_train
    prepare_to_train()  # torch's one-time imports (seconds on a loaded box): not the swarm's start-up
    peers, processes, steps = (int(x) for x in sys.argv[1:4])
    protocol, task = sys.argv[4], sys.argv[5]
    max_dealers = int(sys.argv[6]) if sys.argv[6] else None
    first, last = [], []
    started = time.monotonic()
    def progress(step):
        if not first:
            first.append(time.monotonic())
        last[:] = [time.monotonic()]
    config = SimConfig(peers=peers, protocol=protocol, task=task, steps=steps, processes=processes,
                       transport="tcp" if processes else "inproc", max_dealers=max_dealers)
    result = Simulation(config, progress).run()
    s = result.summary
    ended = time.monotonic()
    print(json.dumps({"start_s": (first[0] if first else ended) - started,
                      "tail_s": ended - (last[0] if last else ended), "total_s": ended - started,
                      "eval_loss": s["eval_loss"],
                      "max_dealers": s.get("max_dealers"), "probe_interval_s": s.get("probe_interval_s"),
                      "finished": sum(1 for p in result.peers if p.status == "finished")}))
""")


def tree_rss_mb(root: int) -> float:
    """Resident memory of `root` and all its descendants, from /proc (MB)."""
    total, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in os.listdir(f"/proc/{pid}/task"):
                children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                stack.extend(int(c) for c in children)
        except (OSError, ValueError):
            continue
    return total / 1024


def run_one(peers: int, processes: int, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(peers), str(processes), str(args.steps),
                             args.protocol, args.task, str(args.max_dealers or "")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    done.set()
    sampler.join()
    row: dict[str, Any] = {"peers": peers, "processes": processes, "protocol": args.protocol, "task": args.task,
                           "steps": args.steps, "wall_s": round(time.monotonic() - started, 1),
                           "peak_rss_mb": round(peak[0], 1), "mb_per_peer": round(peak[0] / peers, 3)}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        row.update(json.loads(lines[-1]))
        row["ok"] = True
    else:
        row.update(ok=False, returncode=proc.returncode, error=(err.strip().splitlines() or ["?"])[-1][:500])
    for key in ("start_s", "tail_s", "total_s"):
        if key in row:
            row[key] = round(row[key], 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="128,256,512,1024")
    parser.add_argument("--processes", default="0,4", help="comma-separated: 0 = threads only, P = P workers")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--protocol", default="gossip")
    parser.add_argument("--task", default="quadratic")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--max-dealers", type=int, default=None,
                        help="the socket cap of every node (default: the simulator's, runtime.capacity.default_cap "
                             "where the descriptors allow it)")
    args = parser.parse_args()
    if args.max_dealers is not None and args.max_dealers < 1:
        parser.error("--max-dealers must be at least 1")
    sizes = [int(x) for x in args.sizes.split(",")]
    for processes in [int(x) for x in args.processes.split(",")]:
        base = run_one(8, min(processes, 8), args)
        base_mb = base["peak_rss_mb"]
        print(json.dumps({**base, "role": "footprint at 8 peers"}), flush=True)
        rows = []
        for n in sizes:
            row = run_one(n, processes, args)
            row["mb_per_peer_beyond_base"] = round((row["peak_rss_mb"] - base_mb) / (n - 8), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        good = [r for r in rows if r.get("ok")]
        if len(good) > 1:
            first = good[0]
            print(json.dumps({"processes": processes, "start_growth": {
                str(r["peers"]): {"size_ratio": r["peers"] / first["peers"],
                                  "start_ratio": round(r["start_s"] / max(first["start_s"], 1e-9), 2)}
                for r in good[1:]}}), flush=True)


if __name__ == "__main__":
    main()
