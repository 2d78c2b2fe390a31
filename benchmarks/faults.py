"""Fault injection, Jepsen-style: kill or stop one peer at a chosen message of a round, with
real `starling node start` processes, and check that the survivors end up with one outcome.

    python benchmarks/faults.py [--quick] [--seed N] [--runs K] [--peers 4]
                                [--protocols allreduce,diloco,...] [--points reduce.owner.closing,...]
    python benchmarks/faults.py --case allreduce/reduce.owner.closing@4:kill/2   # replay one run

Each run starts `--peers` processes on loopback tcp (the first, then the others joining it),
training the `quadratic` task with a progress line per step that carries the digest of the
state every member should hold alike (`--log-digest`: allreduce's and sketch-dp's parameters,
DiLoCo's outer parameters). One of them, the victim, is told through `STARLING_FAULT`
(`common/faults.py`) to fail at a fault point in a given round:

    reduce.owner.closing         an owner holding every part of a group, before it answers
    reduce.member.first_average  a member whose first average came back, the others still out
    quorum.leader.closing        a quorum leader that decided a closing set, before telling it
    secure.unmasker.gathered     secure aggregation's unmasker, holding the round's secrets it
                                 asked the holders for, before it passes them on
    train.step                   a peer at the start of a step
    join.fetched                 a joiner that has the swarm's state, before it loads it (a
                                 fresh joiner is the victim: it joins as the others start)

and the action is `kill` (SIGKILL), `pause` (SIGSTOP, then SIGCONT once the others went on
without it: a stalled peer that comes back behind, and must end with the others' state; it is
checked as a survivor) or `stop` (SIGSTOP, then SIGKILL once the survivors went on
without it: a stalled peer). The survivors train to `--steps` and stop. The invariant
checked, from the fault's round on: no survivor stays apart from the others for more than one
round (`longest_apart_steps`; a round whose members' views split, or whose owner answered some
members and not others, is repaired at the end of the next one), and their final digests
agree. Apart means, where members step in lock-step (allreduce, sketch-dp), a different digest
at the same step; in DiLoCo's family, where a member that fell behind holds a newer round's
state at an earlier step, a digest no other survivor held. `one_outcome` is the verdict. A run
whose victim never reached its point is reported as such (`fired`: false).

Nobody in these runs attacks, so each row also counts the survivors' false accusations (a ban,
or an average that failed its check: `false_accusations`, which must be 0); the `-checked`
protocols run one owner per shard whose averages members check after every round, and
`allreduce-robust` the same with CenteredClip and its watches.

A seeded schedule picks each run's protocol, point, round, action and victim, so one failing
run is replayed with `--case` (each row prints its case). Rows are JSON; the last one sums up.
`--quick` is the one case CI runs: allreduce, an owner SIGKILLed holding every part of round 4.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nodeprocs import NodeProcess, kill_all  # a sibling script module (benchmarks/ is not a package)

FAST = ["--plaintext", "--probe-interval-s", "0.2", "--suspicion-s", "3", "--log-every", "1", "--log-digest",
        "--log-level", "info"]
# Every member owns a shard, so that whichever member is the victim reaches an owner's fault
# point (the default gives a small model's round two owners, drawn for a term of rounds).
OWN = ["--opt", "min_shard_numel=1"]
# protocol -> (its options, steps a run trains, the first round a fault may fire in, rounds per step)
PROTOCOLS: dict[str, tuple[list[str], int]] = {
    "allreduce": (["--lr", "0.05"], 14),
    "diloco": (["--sync-every", "2"], 20),
    "streaming-diloco": (["--sync-every", "4", "--fragments", "2", "--overlap-steps", "1"], 24),
    "sketch-dp": (["--opt", "noise_multiplier=0"], 14),
    "diloco-quorum": (["--sync-every", "2", "--opt", "quorum=2"], 20),
    "allreduce-secure": (["--lr", "0.05", "--compressor", "none", "--opt", "secure_aggregation=on"], 14),
    # one owner, its averages checked by members drawn after each round (collectives/checking.py);
    # the plain mean: quadratic's peers each fit their own target, which a robust aggregator's
    # running test reads as parts pointing away from the others' (docs/security.md, the gaps)
    "allreduce-checked": (["--lr", "0.05", "--opt", "check_rate=1.0"], 14),
    "streaming-diloco-checked": (["--sync-every", "4", "--fragments", "2", "--overlap-steps", "1", "--opt",
                                  "check_rate=1.0"], 24),
    # CenteredClip and its watches (replays, outliers), with one checked owner
    "allreduce-robust": (["--lr", "0.05", "--opt", "aggregator=centered_clip", "--opt", "check_rate=1.0"], 14),
}
POINTS = ("reduce.owner.closing", "reduce.member.first_average", "train.step", "join.fetched",
          "quorum.leader.closing", "secure.unmasker.gathered")
# Protocols whose members step in lock-step hold the same state at the same step. In DiLoCo's
# family a member that fell behind takes the swarm's newer outer state, so at one step two
# members may hold states of different rounds: there, no survivor may hold a state that no
# other survivor ever held.
LOCKSTEP = ("allreduce", "sketch-dp", "allreduce-secure", "allreduce-checked", "allreduce-robust")
JOIN_STEPS_FACTOR = 4  # a swarm that a joiner comes to trains this many times longer


@dataclass(frozen=True)
class Case:
    protocol: str
    point: str
    round: int
    action: str
    victim: int  # which process (0 is the first, the one the others join; peers: a fresh joiner)

    def __str__(self) -> str:
        return f"{self.protocol}/{self.point}@{self.round}:{self.action}/{self.victim}"

    @classmethod
    def parse(cls, text: str) -> Case:
        protocol, fault, victim = text.split("/")
        point, rest = fault.split("@")
        round_, action = rest.split(":")
        if protocol not in PROTOCOLS:
            raise SystemExit(f"--case: unknown protocol {protocol!r} (known: {', '.join(PROTOCOLS)})")
        return cls(protocol, point, int(round_), action, int(victim))


def schedule(seed: int, runs: int, peers: int, protocols: list[str], points: list[str]) -> list[Case]:
    """`runs` cases drawn from `seed`: the same seed gives the same runs."""
    rng = random.Random(seed)
    cases = []
    for _ in range(runs):
        protocol, point = rng.choice(protocols), rng.choice(points)
        if point == "quorum.leader.closing" and protocol != "diloco-quorum":
            point = "reduce.owner.closing"
        if point == "secure.unmasker.gathered" and protocol != "allreduce-secure":
            point = "reduce.member.first_average"
        if point == "join.fetched":
            victim = peers  # a joiner that comes once the others train
        else:
            victim = rng.randrange(peers)
        steps_per_round = 1 if protocol in LOCKSTEP else 2
        round_ = rng.randrange(3, 6) if point != "train.step" else rng.randrange(3, 6) * steps_per_round
        cases.append(Case(protocol, point, round_, rng.choice(["kill", "kill", "stop", "pause"]), victim))
    return cases


def run_case(case: Case, peers: int, log_dir: str) -> dict[str, Any]:
    options, steps = PROTOCOLS[case.protocol]
    if case.victim == peers:  # long enough for a joiner to come while the swarm trains
        steps *= JOIN_STEPS_FACTOR
    protocol = case.protocol.split("-checked")[0].split("-robust")[0].removesuffix("-quorum").removesuffix("-secure")
    action = "stop" if case.action == "pause" else case.action
    at = "" if case.point == "join.fetched" or case.round < 0 else f"@{case.round}"  # round -1: the first reached
    fault = {"STARLING_FAULT": f"{case.point}{at}:{action}"}

    def start(i: int, args: list[str]) -> NodeProcess:
        return NodeProcess([*FAST, "--steps", str(steps), *args], os.path.join(log_dir, f"{i}.log"),
                           env_extra=fault if i == case.victim else None)

    began = time.monotonic()
    first = start(0, ["--protocol", protocol, "--task", "quadratic", "--min-peers", str(peers),
                      "--round-timeout-s", "4",
                      *options, *OWN])
    procs = [first]
    try:
        address = first.wait_for_address()
        # every peer trains once it sees all the others: round 0 begins with one view everywhere
        procs += [start(i, ["--join", address, "--min-peers", str(peers)]) for i in range(1, peers)]
        deadline = time.monotonic() + 240
        if case.victim == peers:  # a joiner the others do not wait for: it fetches their state as they start
            procs.append(start(peers, ["--join", address]))
        victim = procs[case.victim]
        stopped_at = None
        comes_back = case.action == "pause"
        while any(p.alive() for p in procs if p is not victim or comes_back):
            quit_early = [p for p in procs if p is not victim and not p.alive() and p.stopped is None]
            if quit_early:
                raise RuntimeError(f"a survivor exited before it stopped training: {quit_early[0].log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"survivors did not finish within 240 s: {case}")
            if case.action in ("stop", "pause") and victim.alive() and _stopped(victim.pid):
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > 8.0:  # stalled long enough to be declared dead
                    if comes_back:
                        os.kill(victim.pid, signal.SIGCONT)
                    else:
                        victim.kill()
            if not comes_back and not victim.alive() and all(not p.alive() or p.stopped for p in procs):
                break
            time.sleep(0.1)
        for p in procs:
            p.wait(30)
        fired = any("fault point" in line and "reached" in line for line in victim.log_tail(lines=1 << 20))
        survivors = [p for p in procs if p is not victim or comes_back]
        wall_s = round(time.monotonic() - began, 1)
        # nobody here attacks: a ban, or an average that failed its check, is a false accusation
        logged = [line for p in survivors for line in p.log_tail(lines=1 << 20)]
        false = sum(1 for line in logged if ": banned " in line or "fails its check" in line)
        return {"case": str(case), "fired": fired, **check(case, survivors), "false_accusations": false,
                "wall_s": wall_s}
    finally:
        for p in procs:
            p.close()


def check(case: Case, survivors: list[NodeProcess]) -> dict[str, Any]:
    """The invariant: from the fault's round on, no survivor stays apart from the others for
    more than one round (a round whose views split is repaired at the end of the next)."""
    by_step: dict[int, dict[int, str]] = defaultdict(dict)
    for i, p in enumerate(survivors):
        for record in p.records:
            if record.get("synced"):
                by_step[int(record["step"])][i] = record["synced"]
    per_round = 1 if case.protocol in LOCKSTEP else 2  # steps between two rounds of fragment 0
    start = case.round if case.point == "train.step" else case.round * per_round
    compared = [s for s in sorted(by_step) if s >= start and len(by_step[s]) > 1]
    diverged = {s for s in compared if len(set(by_step[s].values())) > 1}
    holders: dict[str, set[int]] = defaultdict(set)  # digest -> survivors that held it at some compared step
    for s in compared:
        for i, digest in by_step[s].items():
            holders[digest].add(i)
    private = {d for d, who in holders.items() if len(who) == 1}
    if case.protocol in LOCKSTEP:  # the same step, the same state
        apart = [s in diverged for s in compared]
    else:  # a step at which some survivor held a state no other survivor ever held
        apart = [any(d in private for d in by_step[s].values()) for s in compared]
    longest = run = 0
    for is_apart in apart:
        run = run + 1 if is_apart else 0
        longest = max(longest, run)
    finals = [p.records[-1].get("synced") if p.records else None for p in survivors]
    finished = [p.stopped is not None for p in survivors]
    agree = len(set(finals)) == 1 and None not in finals
    return {"steps_compared": len(compared), "steps_diverged": len(diverged), "first_diverged": sorted(diverged)[:3],
            "private_states": len(private), "longest_apart_steps": longest, "final_agree": agree,
            "survivors_finished": all(finished),
            "one_outcome": longest <= per_round and agree and all(finished)}


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the one case CI runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--points", default=",".join(POINTS))
    parser.add_argument("--case", action="append", default=[], help="replay one case (as a row prints it)")
    parser.add_argument("--log-dir", default=None, help="keep each process's log here (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.quick:
        cases = [Case("allreduce", "reduce.owner.closing", 4, "kill", 2)]
    elif args.case:
        cases = [Case.parse(c) for c in args.case]
    else:
        cases = schedule(args.seed, args.runs, args.peers, args.protocols.split(","), args.points.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for n, case in enumerate(cases):
                log_dir = os.path.join(args.log_dir or tmp, f"run{n}")
                os.makedirs(log_dir, exist_ok=True)
                row = run_case(case, args.peers, log_dir)
                row["logs"] = log_dir if args.log_dir else None
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            kill_all()
    bad = [r for r in rows if not r["one_outcome"]]
    summary = {"summary": True, "seed": args.seed, "runs": len(rows), "fired": sum(r["fired"] for r in rows),
               "diverged_runs": len(bad), "cases_diverged": [r["case"] for r in bad]}
    print(json.dumps(summary), flush=True)
    return rows


if __name__ == "__main__":
    main()
