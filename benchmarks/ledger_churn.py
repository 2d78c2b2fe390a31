"""Every unit of data once, under churn, with real `starling node start` processes: how many
units a swarm trains twice, or never, when peers are SIGKILLed mid-step, join, and the most
senior member is restarted from its checkpoint.

    python benchmarks/ledger_churn.py [--peers 8] [--duration-s 600] [--every-s 30] [--seed 0]
                                      [--quick]

Target: 8 processes, a SIGKILL and a join every 30 s for 10 minutes, one of the kills the
senior member's, restarted as the docs say (the same `--key`, `--resume` its checkpoint folder,
`--join` a live peer): at most 0.5% of units trained twice, and at most the units in flight at
the kills never trained.

The swarm trains `allreduce` on the gpt task over a generated folder of text (`--seq-len 32`,
336 units an epoch) with a progress line per step, which names the unit the step trained and
whether the swarm's update held it (`unit`, `counted`). Every `--every-s` a peer drawn by
`--seed` is SIGKILLed (wherever it is in its step: the kill lands mid-round) and a fresh peer
joins; the third kill is the first peer's (the most senior member), which comes back as
itself. Every process checkpoints every 5 steps. At `--duration-s` every live peer gets
SIGTERM.

Counted from every process's lines (those of killed ones up to their death): a unit is trained
in an epoch when some line says it was trained there and counted. Trained twice: a unit
counted twice in one epoch. Never trained: in every epoch that the swarm finished (a later one
began), the units no line counted, against the kills (each kill can lose the unit in flight).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nodeprocs import NodeProcess, kill_all  # a sibling script module (benchmarks/ is not a package)

WORDS = "the quick brown fox jumps over a lazy dog while seven peers train one model across slow links".split()
COMMON = ["--plaintext", "--log-every", "1", "--log-level", "info", "--checkpoint-every", "5"]


def corpus(folder: str, seed: int) -> None:
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    for d in range(24):
        with open(os.path.join(folder, f"doc{d:02d}.txt"), "w") as f:
            f.write(" ".join(rng.choice(WORDS) for _ in range(700)) + "\n")


def keygen(path: str) -> None:
    subprocess.run([sys.executable, "-m", "starling.cli.main", "keygen", "--out", path], check=True,
                   capture_output=True)


class Churn:
    def __init__(self, args: argparse.Namespace, work: str) -> None:
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.procs: list[NodeProcess] = []
        self.kills = 0
        self.senior_restarted = False

    def launch(self, n: int, extra: list[str]) -> NodeProcess:
        key = os.path.join(self.work, f"key{n}")
        if not os.path.exists(key):
            keygen(key)
        ckpt = os.path.join(self.work, f"ckpt{n}")
        proc = NodeProcess([*COMMON, "--key", key, "--checkpoint-dir", ckpt, *extra],
                           os.path.join(self.work, f"{n}-{len(self.procs)}.log"))
        proc.index = n  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def live(self) -> list[NodeProcess]:
        return [p for p in self.procs if p.alive() and p.address]

    def run(self) -> None:
        a = self.args
        data = os.path.join(self.work, "corpus")
        corpus(data, a.seed)
        first = self.launch(0, ["--protocol", "allreduce", "--data", data, "--seq-len", "32", "--min-peers",
                                str(a.peers), "--round-timeout-s", "5", "--lr", "0.001"])
        address = first.wait_for_address()
        for n in range(1, a.peers):
            self.launch(n, ["--join", address, "--min-peers", str(a.peers)])
        deadline = time.monotonic() + 300
        while not all(p.records for p in self.procs):
            if time.monotonic() > deadline:
                raise RuntimeError("the swarm did not start training")
            time.sleep(0.2)
        began = time.monotonic()
        next_event, fresh = began + a.every_s, a.peers
        while time.monotonic() - began < a.duration_s:
            time.sleep(0.2)
            if time.monotonic() < next_event:
                continue
            next_event += a.every_s
            live = self.live()
            if len(live) < 2:
                continue
            senior = next((p for p in live if p.index == 0), None)  # type: ignore[attr-defined]
            if self.kills == 2 and senior is not None:
                senior.kill()
                self.kills += 1
                seed = next(p for p in self.live() if p is not senior).address
                self.launch(0, ["--resume", os.path.join(self.work, "ckpt0"), "--join", seed])
                self.senior_restarted = True
                continue
            victim = self.rng.choice([p for p in live if p is not senior] or live)
            victim.kill()
            self.kills += 1
            seed = next(p for p in self.live() if p is not victim).address
            self.launch(fresh, ["--join", seed])
            fresh += 1
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(60)

    def summary(self) -> dict[str, Any]:
        counted: Counter[tuple[int, int]] = Counter()
        epochs: set[int] = set()
        units_per_epoch = 0
        for p in self.procs:
            for record in p.records:
                unit = record.get("unit")
                if unit is None:
                    continue
                epochs.add(int(unit[0]))
                if record.get("counted"):
                    counted[(int(unit[0]), int(unit[1]))] += 1
        units_per_epoch = self.args.units
        done = sorted(e for e in epochs if e + 1 in epochs)  # epochs the swarm finished
        trained = sum(1 for (e, _), n in counted.items() if n > 0 and e in done)
        twice = sum(n - 1 for (e, _), n in counted.items() if n > 1 and e in done)
        never = sum(units_per_epoch - len({i for (e2, i) in counted if e2 == e}) for e in done)
        total = units_per_epoch * len(done)
        return {"bench": "ledger_churn", "peers": self.args.peers, "duration_s": self.args.duration_s,
                "kills": self.kills, "senior_restarted": self.senior_restarted, "epochs_finished": len(done),
                "units": total, "trained": trained, "trained_twice": twice,
                "twice_share": round(twice / total, 5) if total else None, "never_trained": never,
                "met": bool(total) and twice <= 0.005 * total and never <= self.kills}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--every-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--units", type=int, default=336, help="units an epoch of the generated corpus holds")
    parser.add_argument("--quick", action="store_true", help="4 peers, 70 s, an event every 20 s")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.peers, args.duration_s, args.every_s = 4, 70.0, 20.0
    with tempfile.TemporaryDirectory() as tmp:
        work = args.log_dir or tmp
        os.makedirs(work, exist_ok=True)
        churn = Churn(args, work)
        try:
            churn.run()
        finally:
            kill_all()
        row = churn.summary()
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
