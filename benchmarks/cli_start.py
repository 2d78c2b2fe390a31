"""How long a CLI command that only talks to a node takes: `starling node status ADDRESS --json`
against one running node, as shipped (torch is not loaded) and with torch loaded first, as
every CLI process did while the wire module imported it at its top.

    python benchmarks/cli_start.py [--repeats 7] [--quick]

Target: none; the row backs docs/cli.md's word that `node status`, `node watch` and `keygen`
start without torch. The two kinds of run alternate (a noisy box loads both alike); each row
is the median wall time and CPU (user + system, `RUSAGE_CHILDREN`) of one command, and the
ratios are torch-first over as shipped. Every run must print the node's status (exit 0).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from nodeprocs import NodeProcess, children_cpu_s, kill_all

# The baseline: the same command in a process that imports torch before the CLI runs.
TORCH_FIRST = "import runpy, sys, torch; sys.argv[0] = 'starling'; runpy.run_module('starling.cli.main', " \
              "run_name='__main__')"


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)



def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one command, which must succeed and print a status."""
    cpu, start = children_cpu_s(), time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - start
    if done.returncode != 0 or '"peers"' not in done.stdout:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed ({done.returncode}): {done.stderr[-500:]}")
    return wall, children_cpu_s() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="one of each, for a smoke test")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    node = NodeProcess(["--plaintext", "--log-level", "warning"])
    try:
        address = node.wait_for_address()
        status = ["node", "status", address, "--json"]
        runs: dict[str, list[tuple[float, float]]] = {"shipped": [], "torch_first": []}
        for _ in range(repeats):
            runs["shipped"].append(timed([sys.executable, "-m", "starling.cli.main", *status]))
            runs["torch_first"].append(timed([sys.executable, "-c", TORCH_FIRST, *status]))
    finally:
        kill_all()
    rows = {}
    for kind, samples in runs.items():
        rows[kind] = {"bench": "node_status", "run": kind, "repeats": repeats,
                      "wall_s": round(statistics.median(w for w, _ in samples), 3),
                      "cpu_s": round(statistics.median(c for _, c in samples), 3)}
        emit(rows[kind])
    shipped, first = rows["shipped"], rows["torch_first"]
    emit({"bench": "summary", "wall_ratio": round(first["wall_s"] / shipped["wall_s"], 2),
          "cpu_ratio": round(first["cpu_s"] / max(shipped["cpu_s"], 1e-3), 2)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
