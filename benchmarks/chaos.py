"""Chaos soak: a swarm of real `starling node start` processes in which one peer is SIGKILLed
and a new one joins every `--kill-every-s`, against the same swarm without failures.

    python benchmarks/chaos.py [--peers 16] [--duration-s 600] [--kill-every-s 30]
                               [--protocols allreduce,streaming-diloco] [--seed 0] [--quick]

Target: 16 peers, one SIGKILLed and one joining every 30 s for 10 minutes, for
`allreduce` and `streaming-diloco`: 0 deadlocks; the share of steps committed within 5 points
of the analytic bound; eval loss within 5% of a run without failures. (torchft reports 82.3%
committed against 83.3% expected at one failure a minute.)

The swarm. `--peers` processes on loopback tcp (`--plaintext`, `OMP_NUM_THREADS=1` each) with
the CLI's default liveness (heartbeat 1 s, suspect 3 s, dead 10 s, probe 1 s) train a tiny
`charlm` (one layer, 17k parameters), peer i on data shard i of `--peers`, and start together
(`--min-peers`). Every `--kill-every-s` after the whole swarm trains, a peer drawn by `--seed`
(any of them, the first included) is SIGKILLed and a replacement starts at once: it joins
through up to 3 live peers, takes the victim's shard (as a replacement replica would), fetches
the swarm's state and continues at its step. At `--duration-s` every live peer gets SIGTERM and
prints its eval loss.

The baseline: the same swarm, options and seed, without failures, trained to the step the
failure run reached (the median of its survivors' final steps). Equal steps, not equal wall
time: the eval ratio then measures what the failures did to the model, and the progress share
measures the time they cost; a shared box's load, which changes a run's steps per second from
one run to the next, enters neither figure through the other run's step count.

What the row reports, per protocol (figures of the peers that lived through the whole window,
the initial peers never killed, averaged over them):
- deadlocks: a peer that trains and prints no progress line for longer than
  `--deadlock-after-s` (3 x the round timeout), a peer that exits unexpectedly (any exit before
  its SIGTERM, or a non-zero status after it), a replacement that never starts training, and a
  peer that has not exited 60 s after its SIGTERM; each with details. A replacement still
  starting up (no address yet) at the end dies of the SIGTERM: `startup_terminated`, not a hang.
- committed_share, counted torchft's way: a step is committed unless a failure inside it kept
  its update from including a member. Starling never retries a step: a member that dies during
  a round is left out of it (a shard it owned counts as 0 on every member, in allreduce as in
  DiLoCo) and every peer goes on. So a step is committed when its progress line
  says `lost` = 0 (DiLoCo's steps without an exchange are local and always committed; a member
  that said it sends nothing in a round, a joiner catching up, is skipped, not lost).
- its bound. With one kill and one join every T seconds and r steps per second, a kill leaves
  k_kill uncommitted steps: allreduce blocks in the round in flight until the death is seen
  (the probe timeout d = 1 s after the kernel drops the dead peer's connections) and leaves the
  victim out of the next: k_kill = 1. DiLoCo: the fragment round in flight, if any, plus those
  begun before the death is seen, one every H/F steps: k_kill = 1 + d r F / H. A join costs at
  most k_join = 1 (views that disagree for a moment when the joiner says hello):

      bound = 1 - (k_kill + k_join) / (r T)

- progress_share: the share of the window in which the peer was not stalled by a failure,
  1 - (stall after each kill + stall from each replacement's hello to its first step) / D,
  a stall being the longest gap between two progress lines in that span less a typical step.
  Its bound: a kill stalls by d plus a step, a join by about one step:

      progress bound = 1 - (d + 2 / r) / T

- eval loss: the `stopped` lines' eval_loss over the peers alive at the end, for the failure
  run and the baseline, and their ratio: the median (the replica most peers hold; an allreduce
  peer that missed a shard at a kill, or one whose first round after a join went solo, holds
  another until the drift guard's next check), and the mean.
- counts: kills, joins, replacements that started training, and each one's time from launch to
  its `training` event and to its first step.

Prints one JSON row per protocol; `--out FILE` also writes every row with its raw timelines.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nodeprocs import NodeProcess, kill_all  # a sibling script module (benchmarks/ is not a package)

TASK = ["--task", "charlm", "--task-opt", "n_layer=1", "--task-opt", "n_embd=32", "--task-opt", "n_head=2",
        "--task-opt", "seq_len=32", "--task-opt", "batch_size=8", "--task-opt", "corpus_chars=300000"]
OPTIONS = {
    "allreduce": ["--opt", "optimizer=adamw", "--lr", "0.003"],
    "streaming-diloco": ["--lr", "0.003", "--sync-every", "16", "--fragments", "4", "--overlap-steps", "1"],
}
PROBE_TIMEOUT_S = 1.0  # the CLI's default --probe-timeout-s: the detection delay d
STOP_GRACE_S = 60.0  # a peer that has not exited this long after SIGTERM hangs
KILL_WINDOW_S = 2.0  # a kill's stall begins within this long (the probe timeout, and a step)


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


@dataclass
class Member:
    """A process of the run and what happened to it (times are monotonic)."""

    index: int
    shard: int
    node: NodeProcess
    joiner: bool
    killed_at: float | None = None
    stopped_at: float | None = None  # when it got SIGTERM
    flagged: set[str] = field(default_factory=set)  # deadlock episodes already reported


class Soak:
    """One run: start the swarm, kill and replace peers on schedule, watch for deadlocks."""

    def __init__(self, args: argparse.Namespace, protocol: str, failures: bool, steps: int | None,
                 log_dir: str) -> None:
        self.args, self.protocol, self.failures, self.steps = args, protocol, failures, steps
        self.label = "failures" if failures else "baseline"
        self.log_dir = log_dir
        self.rng = random.Random(args.seed)
        self.members: list[Member] = []
        self.kills: list[dict[str, Any]] = []
        self.deadlocks: list[dict[str, Any]] = []
        # replacements still starting (no address yet) when the run ended: SIGTERM ends them
        # before their handler is installed, which is not a hang
        self.startup_terminated: list[int] = []
        self.t0 = self.t_end = 0.0

    # ------------------------------------------------------------------ processes
    def _common(self) -> list[str]:
        return ["--plaintext", "--log-every", "1", "--log-level", "info"]

    def _launch(self, shard: int, extra: list[str], joiner: bool) -> Member:
        index = len(self.members)
        log = os.path.join(self.log_dir, f"{self.protocol}-{self.label}-{index:02d}.log")
        node = NodeProcess([*self._common(), "--shard", f"{shard}/{self.args.peers}", *extra], log)
        member = Member(index, shard, node, joiner)
        self.members.append(member)
        return member

    def live(self) -> list[Member]:
        return [m for m in self.members if m.killed_at is None and m.stopped_at is None]

    def start(self) -> None:
        a = self.args
        steps = ["--steps", str(self.steps)] if self.steps is not None else []
        swarm = ["--min-peers", str(a.peers), *steps]
        first = self._launch(0, [*swarm, "--protocol", self.protocol, *TASK,
                                 "--round-timeout-s", str(a.round_timeout_s), *OPTIONS[self.protocol]], False)
        address = first.node.wait_for_address(300)
        for shard in range(1, a.peers):
            self._launch(shard, [*swarm, "--join", address], False)
        deadline = time.monotonic() + a.start_timeout_s
        while not all(m.node.steps for m in self.members):
            self._check_exits()
            if self.deadlocks or time.monotonic() > deadline:
                waiting = [m.index for m in self.members if not m.node.steps]
                raise RuntimeError(f"{self.protocol} {self.label}: the swarm did not start training "
                                   f"(peers {waiting} have no step; {self.deadlocks}); logs in {self.log_dir}")
            time.sleep(0.2)
        self.t0 = time.monotonic()

    def kill_and_replace(self, now: float) -> None:
        candidates = [m for m in self.live() if m.node.steps]
        victim = self.rng.choice(candidates)
        victim.node.kill()
        victim.killed_at = now
        sources = [m for m in self.live() if m is not victim and m.node.address and m.node.steps]
        joins = [arg for m in self.rng.sample(sources, min(3, len(sources))) for arg in ("--join", m.node.address)]
        replacement = self._launch(victim.shard, joins, True)
        self.kills.append({"at_s": round(now - self.t0, 2), "victim": victim.index,
                           "victim_step": victim.node.steps[-1].step if victim.node.steps else None,
                           "replacement": replacement.index})

    # ------------------------------------------------------------------ watching
    def _deadlock(self, member: Member, kind: str, **details: Any) -> None:
        if kind in member.flagged:
            return
        member.flagged.add(kind)
        self.deadlocks.append({"kind": kind, "peer": member.index, "at_s": round(time.monotonic() - self.t0, 2),
                               **details, "log": member.node.log_path, "log_tail": member.node.log_tail(3)})

    def _check_exits(self) -> None:
        for m in self.members:
            code = m.node.proc.poll()
            if code is not None and m.killed_at is None and m.stopped_at is None and not self._finished(m):
                self._deadlock(m, "exited", status=code)

    def _finished(self, member: Member) -> bool:
        """A baseline peer that reached --steps stops by itself, with status 0."""
        return self.steps is not None and member.node.stopped is not None and member.node.proc.poll() == 0

    def _check_progress(self, now: float) -> None:
        bound = self.args.deadlock_after_s
        for m in self.live():
            last = m.node.last_progress()
            if last is not None and now - last > bound and not self._finished(m) and m.node.alive():
                self._deadlock(m, "no_progress", silent_s=round(now - last, 1),
                               step=m.node.steps[-1].step if m.node.steps else None)
            elif last is None and m.joiner and now - m.node.launched_at > self.args.join_timeout_s:
                self._deadlock(m, "never_joined", waited_s=round(now - m.node.launched_at, 1))

    def run(self) -> None:
        a = self.args
        self.start()
        next_kill = self.t0 + a.kill_every_s
        while True:
            now = time.monotonic()
            self._check_exits()
            self._check_progress(now)
            if self.steps is not None:
                if all(m.node.proc.poll() is not None for m in self.members):
                    break
                if now - self.t0 > a.duration_s * 4 + 300:
                    self._deadlock(self.members[0], "baseline_unfinished", step=self.members[0].node.steps[-1].step)
                    break
            elif now >= self.t0 + a.duration_s:
                break
            if self.failures and now >= next_kill:
                self.kill_and_replace(now)
                next_kill += a.kill_every_s
            time.sleep(0.1)
        self.t_end = time.monotonic()
        self.stop()

    def stop(self) -> None:
        for m in self.live():
            m.stopped_at = time.monotonic()
            m.node.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for m in self.members:
            if m.killed_at is not None:
                m.node.wait(10)
                continue
            code = m.node.wait(max(0.1, deadline - time.monotonic()))
            if code is None:
                self._deadlock(m, "stop_hang", waited_s=STOP_GRACE_S)
            elif code == -15 and not m.node.address and m.joiner:
                self.startup_terminated.append(m.index)
            elif code != 0 and "exited" not in m.flagged:
                self._deadlock(m, "exited", status=code, after_sigterm=m.stopped_at is not None)
        for m in self.members:
            m.node.close()

    # ------------------------------------------------------------------ figures
    def survivors(self) -> list[Member]:
        """The initial peers that lived through the whole window."""
        return [m for m in self.members if not m.joiner and m.killed_at is None]

    def window_steps(self, m: Member) -> list[Any]:
        return [p for p in m.node.steps if self.t0 <= p.at <= self.t_end]

    def event_stall(self, m: Member, lo: float, hi: float, typical: float) -> float:
        """The longest gap between two of the peer's progress lines that overlaps [lo, hi], less
        a typical step (0 when none is longer)."""
        times = [p.at for p in m.node.steps]
        gaps = [b - a for a, b in itertools.pairwise(times) if b >= lo and a <= hi]
        return max(0.0, max(gaps) - typical) if gaps else 0.0

    def stalls(self, m: Member, typical: float) -> list[dict[str, Any]]:
        """What each kill and each join cost this peer: the longest stall in the KILL_WINDOW_S
        after the victim died (the round that waits for it may begin just after), and the
        longest from the replacement's hello (it is then a member of the others' rounds) to
        1 s after it began to train."""
        out = []
        for k in self.kills:
            at = self.t0 + k["at_s"]
            stall = self.event_stall(m, at, at + KILL_WINDOW_S, typical)
            out.append({"event": "kill", "at_s": k["at_s"], "stall_s": round(stall, 3)})
            joiner = self.members[k["replacement"]].node
            if joiner.address_at is not None and joiner.address_at < self.t_end:
                end = min(self.t_end, (joiner.training_at or self.t_end) + 1.0)
                out.append({"event": "join", "at_s": round(joiner.address_at - self.t0, 2),
                            "stall_s": round(self.event_stall(m, joiner.address_at, end, typical), 3)})
        return out

    def kills_per_round(self, rate: float) -> float:
        """k_kill: the rounds, hence steps, of a survivor that go on without a victim. allreduce
        blocks in the round in flight until the death is seen, then leaves the victim out of
        the next one: 1. DiLoCo: the fragment round in flight, if any (at most 1), plus the
        rounds begun while the death was not yet seen, one every H/F steps: d r F / H."""
        if self.protocol == "allreduce":
            return 1.0
        options = OPTIONS[self.protocol]
        h, f = (int(options[options.index(flag) + 1]) for flag in ("--sync-every", "--fragments"))
        return 1.0 + PROBE_TIMEOUT_S * rate * f / h

    def summary(self) -> dict[str, Any]:
        a = self.args
        window = self.t_end - self.t0
        stopped = [m.node.stopped for m in self.members if m.stopped_at is not None or self._finished(m)]
        evals = [s["eval_loss"] for s in stopped if s and "eval_loss" in s]
        final_steps = [s["step"] for s in stopped if s]
        peers: list[dict[str, Any]] = []
        for m in self.survivors():
            steps = self.window_steps(m)
            committed = sum(1 for p in steps if p.lost == 0)
            gaps = [b.at - a_.at for a_, b in itertools.pairwise(m.node.steps)]
            typical = statistics.median(gaps) if gaps else float("nan")
            stalls = self.stalls(m, typical)
            lost_s = sum(e["stall_s"] for e in stalls)
            peers.append({"peer": m.index, "steps": len(steps), "committed": committed,
                          "committed_share": committed / len(steps) if steps else float("nan"),
                          "rate_steps_per_s": len(steps) / window, "typical_step_s": typical,
                          "stalled_s": lost_s, "progress_share": 1.0 - lost_s / window, "stalls": stalls})
        joins = []
        for k in self.kills:
            j = self.members[k["replacement"]]
            joins.append({"peer": j.index, "launched_at_s": round(j.node.launched_at - self.t0, 2),
                          "to_training_s": round(j.node.training_at - j.node.launched_at, 2)
                          if j.node.training_at else None,
                          "to_first_step_s": round(j.node.steps[0].at - j.node.launched_at, 2)
                          if j.node.steps else None,
                          "start_step": j.node.training["step"] if j.node.training else None})

        def mean(key: str) -> float:
            return statistics.mean(p[key] for p in peers) if peers else float("nan")

        def per_event(kind: str) -> float | None:
            values = [e["stall_s"] for p in peers for e in p["stalls"] if e["event"] == kind]
            return round(statistics.median(values), 3) if values else None

        rate, typical = mean("rate_steps_per_s"), mean("typical_step_s")
        t, k_kill, k_join = a.kill_every_s, self.kills_per_round(rate), 1.0
        if self.failures:
            bound_committed = 1.0 - (k_kill + k_join) / (rate * t)
            bound_progress = 1.0 - (PROBE_TIMEOUT_S + 2 * typical) / t
        else:
            bound_committed = bound_progress = 1.0
        share, progress = mean("committed_share"), mean("progress_share")
        return {
            "window_s": round(window, 1), "kills": len(self.kills),
            "joins": len(joins), "joiners_training": sum(1 for j in joins if j["to_first_step_s"] is not None),
            "deadlocks": len(self.deadlocks), "deadlock_details": self.deadlocks,
            "committed_share": round(share, 4), "bound": round(bound_committed, 4),
            "points_below_bound": round(100 * (bound_committed - share), 2),
            "progress_share": round(progress, 4), "progress_bound": round(bound_progress, 4),
            "progress_points_below_bound": round(100 * (bound_progress - progress), 2),
            "rate_steps_per_s": round(rate, 3), "typical_step_s": round(typical, 4),
            "k_kill": round(k_kill, 2), "k_join": k_join,
            "stall_s_per_kill": per_event("kill"), "stall_s_per_join": per_event("join"),
            "startup_terminated": self.startup_terminated,
            "final_step_median": statistics.median(final_steps) if final_steps else None,
            # the replica most peers hold: allreduce peers that missed a shard at a kill, or a
            # joiner's first round, differ until the drift guard's next check repairs them
            "eval_loss": round(statistics.median(evals), 5) if evals else None,
            "eval_loss_mean": round(statistics.mean(evals), 5) if evals else None,
            "eval_loss_range": [round(min(evals), 5), round(max(evals), 5)] if evals else None,
            "peers_evaluated": len(evals),
            "join_times": joins, "kill_times": self.kills,
            "survivors": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in p.items()} for p in peers],
        }


def run_protocol(args: argparse.Namespace, protocol: str, log_dir: str) -> dict[str, Any]:
    chaos = Soak(args, protocol, True, None, log_dir)
    try:
        chaos.run()
    finally:
        for m in chaos.members:
            m.node.close()
    failures = chaos.summary()
    target_steps = int(failures["final_step_median"] or 0)
    baseline: dict[str, Any] = {"skipped": "the failure run reached no step"}
    if target_steps > 0:
        base = Soak(args, protocol, False, target_steps, log_dir)
        try:
            base.run()
        finally:
            for m in base.members:
                m.node.close()
        baseline = base.summary()
    ratio = ratio_mean = None
    if failures.get("eval_loss") and baseline.get("eval_loss"):
        ratio = round(failures["eval_loss"] / baseline["eval_loss"], 4)
        ratio_mean = round(failures["eval_loss_mean"] / baseline["eval_loss_mean"], 4)
    short = {k: failures[k] for k in ("window_s", "kills", "joins", "joiners_training", "deadlocks",
                                      "committed_share", "bound", "points_below_bound", "progress_share",
                                      "progress_bound", "progress_points_below_bound", "rate_steps_per_s",
                                      "typical_step_s", "stall_s_per_kill", "stall_s_per_join",
                                      "final_step_median", "eval_loss")}
    joined = [j["to_first_step_s"] for j in failures["join_times"] if j["to_first_step_s"] is not None]
    short["join_to_first_step_s_median"] = round(statistics.median(joined), 2) if joined else None
    row = {"protocol": protocol, "peers": args.peers, "duration_s": args.duration_s,
           "kill_every_s": args.kill_every_s, "seed": args.seed, **short,
           "baseline_eval_loss": baseline.get("eval_loss"), "baseline_steps": target_steps,
           "baseline_deadlocks": baseline.get("deadlocks"), "eval_ratio": ratio, "eval_ratio_mean": ratio_mean,
           "eval_loss_range": failures["eval_loss_range"],
           "targets_met": {"no_deadlocks": failures["deadlocks"] == 0 and baseline.get("deadlocks") == 0,
                           "committed_within_5_points": failures["points_below_bound"] <= 5.0,
                           "eval_within_5_percent": ratio is not None and abs(ratio - 1.0) <= 0.05},
           "log_dir": log_dir}
    return {"row": row, "failures": failures, "baseline": baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--protocols", default="allreduce,streaming-diloco")
    parser.add_argument("--seed", type=int, default=0, help="which peer is killed when")
    parser.add_argument("--round-timeout-s", type=float, default=10.0)
    parser.add_argument("--deadlock-after-s", type=float, help="default: 3 x --round-timeout-s")
    parser.add_argument("--join-timeout-s", type=float, default=180.0,
                        help="a replacement not training this long after launch never joined")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--quick", action="store_true", help="6 peers, 90 s, a kill every 20 s")
    parser.add_argument("--log-dir", help="each node's log (level info); default: a new temp dir, kept")
    parser.add_argument("--out", help="also write every row with its raw figures here (JSON)")
    args = parser.parse_args()
    if args.quick:
        args.peers, args.duration_s, args.kill_every_s = 6, 90.0, 20.0
    if args.deadlock_after_s is None:
        args.deadlock_after_s = 3 * args.round_timeout_s
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="starling-chaos-")
    os.makedirs(log_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM, like Ctrl-C, cleans up
    results = []
    try:
        for protocol in args.protocols.split(","):
            result = run_protocol(args, protocol, log_dir)
            results.append(result)
            emit(result["row"])
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1, default=str)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        kill_all()


if __name__ == "__main__":
    main()
