"""A swarm of real `starling node start` processes with one hostile member: five honest
peers and one that scales its gradient by 100 (tests/attacker_node.py runs the same command
with an attack of benchmarks/attacks.py applied to its protocol). With a robust aggregator and
replicated owners, every honest peer ends up banning it (as `node status` shows in its trust
section), none bans an honest peer, and the honest peers finish training."""
from __future__ import annotations

import json
import math
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_zygote import cli_popen

from starling.node.client import query

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("byzantine")]

TESTS = Path(__file__).resolve().parents[1]
HONEST = 5
STEPS = 60
FAST = ["--plaintext", "--probe-interval-s", "0.2", "--suspicion-s", "6"]
# Every honest peer computes the same gradient (no per-peer offsets): what sets the attacker
# apart is its attack, never its data.
SWARM = ["--protocol", "allreduce", "--task", "quadratic", "--task-opt", "peer_spread=0", "--lr", "0.05",
         "--aggregator", "centered_clip", "--owner-replication", "3", "--round-timeout-s", "5"]
RUN = ["--min-peers", str(HONEST + 1), "--steps", str(STEPS), "--log-every", "1"]
# Deadlines: eight Python processes importing torch on a starved 2-core box take a while.
START_S, BAN_S, FINISH_S = 240.0, 180.0, 240.0


class Peer:
    """One node process; its stdout drained on a thread (a full pipe would stall it)."""

    def __init__(self, args: list[str]) -> None:
        self.proc = cli_popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.records: list[dict] = []
        self.id = self.address = ""
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def poll_lines(self) -> None:
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            if "join with:" in line:
                self.id = line.split()[2]
                self.address = line.rsplit("join with:", 1)[1].strip()
            elif line.startswith("{"):
                self.records.append(json.loads(line))

    def event(self, name: str) -> dict | None:
        self.poll_lines()
        return next((r for r in self.records if r.get("event") == name), None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def node(*args: str) -> list[str]:
    return [sys.executable, "-m", "starling.cli.main", "node", "start", *FAST, *args]


def attacker(attack: str, *args: str) -> list[str]:
    return [sys.executable, str(TESTS / "attacker_node.py"), attack, "node", "start", *FAST, *args]


def wait_for(what: str, cond, timeout_s: float, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(interval_s)


def banned_by(peer: Peer) -> dict[str, dict] | None:
    """The peers `peer` has banned and why, from its `node status` trust section; None if it
    did not answer."""
    try:
        status = query(peer.address, timeout_s=5.0)
    except Exception:
        return None
    return dict((status.get("trust") or {}).get("banned") or {})


def test_a_member_that_scales_its_gradient_is_banned_by_every_honest_peer():
    peers: list[Peer] = []
    try:
        first = Peer(node(*SWARM, *RUN))
        peers.append(first)
        wait_for("the first node's address", lambda: (first.poll_lines(), first.address)[1], START_S)
        for _ in range(HONEST - 1):
            peers.append(Peer(node("--join", first.address, *RUN)))
        hostile = Peer(attacker("scale", "--join", first.address, *RUN))
        honest = list(peers)
        peers.append(hostile)
        wait_for("every peer to train", lambda: all(p.event("training") for p in peers), START_S)
        assert hostile.id and len({p.id for p in peers}) == HONEST + 1

        seen: dict[str, dict[str, dict]] = {p.id: {} for p in honest}  # what each honest peer's status showed

        def all_banned() -> bool:
            for p in honest:
                if hostile.id not in seen[p.id]:
                    seen[p.id].update(banned_by(p) or {})
            return all(hostile.id in s for s in seen.values())

        wait_for("every honest peer to ban the attacker", all_banned, BAN_S, interval_s=0.5)
        assert all(set(s) == {hostile.id} for s in seen.values()), seen  # no honest peer banned an honest one
        # its parts were screened out (100 times the others' norm) round after round, by two owners at least
        assert {s[hostile.id]["kind"] for s in seen.values()} == {"part.outlier"}, seen
        training = [p for p in honest if not p.event("stopped")]
        assert len(training) >= HONEST - 1, "the attacker was banned only as the honest peers stopped: raise STEPS"
        for p in training:  # and later: what they hold while they still train
            later = banned_by(p)
            assert later is None or set(later) == {hostile.id}, later
        wait_for("the honest peers to finish training", lambda: all(p.event("stopped") for p in honest), FINISH_S)
        for p in honest:
            assert p.proc.wait(60) == 0
            stopped = p.event("stopped")
            assert stopped["step"] == STEPS and math.isfinite(stopped["eval_loss"]), stopped
    finally:
        for p in peers:
            p.stop()
