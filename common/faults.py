"""Fault points: named places in a round where this process fails for real when told to, so
that a harness (`benchmarks/faults.py`) can kill, stop or cut off a peer at exactly that
message of a round and check what the survivors do, Jepsen-style.

A process is told through its environment, read once at the first point it reaches:

    STARLING_FAULT="POINT[@ROUND][:ACTION][,...]"

    reduce.owner.closing@5:kill        SIGKILL myself when I hold every part of a group of
                                       round 5, before I answer any of them
    reduce.member.first_average:stop   SIGSTOP myself when the first average of a round has
                                       come back and the others are still out (any round)

ACTION is `kill` (SIGKILL, the default), `stop` (SIGSTOP: the harness continues or kills the
process) or `exit` (os._exit(3), no clean-up). Each fault fires once. With no variable set a
point costs one attribute read. The points are listed in `POINTS`; an unknown name in the
variable is an error at the first point reached, so that a typo does not pass as a fault that
never came.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV = "STARLING_FAULT"
ACTIONS = ("kill", "stop", "exit")
POINTS = {
    "reduce.member.first_average": "a member, once the first average of its round came back (its parts reached "
                                   "their owners) and the others are still out",
    "reduce.owner.closing": "an owner holding every part of a group, before it answers any of them",
    "secure.unmasker.gathered": "the round's unmasker, once the holders revealed the round's secrets to it and "
                                "before it passes them on to the other owners",
    "quorum.leader.closing": "a quorum leader that has decided a round's closing set, before it tells anyone",
    "train.step": "a peer at the start of a training step (ROUND is the step)",
    "join.seed.paging": "a member whose whole table a joiner walks, asked for a page past its hello's answer, "
                        "before it answers",
    "join.fetched": "a joiner that has fetched the swarm's state (the others count it a member), before it "
                    "loads it",
}


@dataclass(frozen=True)
class Fault:
    point: str
    round: int | None  # None: the first time the point is reached
    action: str = "kill"

    @classmethod
    def parse(cls, text: str) -> Fault:
        """One `POINT[@ROUND][:ACTION]`; ValueError naming what is wrong."""
        where, _, action = text.strip().partition(":")
        point, at, round_text = where.partition("@")
        action = action or "kill"
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {point!r} (known: {', '.join(sorted(POINTS))})")
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown action {action!r} for {point} (known: {', '.join(ACTIONS)})")
        try:
            round_ = int(round_text) if at else None
        except ValueError:
            raise ValueError(f"{ENV}: the round of {point} must be an integer, got {round_text!r}") from None
        return cls(point, round_, action)

    def __str__(self) -> str:
        return f"{self.point}{'' if self.round is None else f'@{self.round}'}:{self.action}"


def parse_faults(text: str) -> tuple[Fault, ...]:
    return tuple(Fault.parse(part) for part in text.split(",") if part.strip())


class _Armed:
    """The faults this process was told of, each fired at most once (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] | None = None  # None: the environment not read yet

    def _load(self) -> list[Fault]:
        if self._faults is None:
            self._faults = list(parse_faults(os.environ.get(ENV, "")))
            if self._faults:
                log.warning("fault points armed: %s", ", ".join(map(str, self._faults)))
        return self._faults

    def hit(self, point: str, round_: int | None = None) -> None:
        if self._faults is not None and not self._faults:  # none armed, or all fired: no lock
            return
        with self._lock:
            faults = self._load()
            if not faults:
                return
            fault = next((f for f in faults if f.point == point and f.round in (None, round_)), None)
            if fault is None:
                return
            faults.remove(fault)
        log.warning("fault point %s reached in round %s: %s", point, round_, fault.action)
        for handler in logging.getLogger().handlers:  # the harness reads this line before the process goes
            handler.flush()
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os._exit(3)


_armed = _Armed()


def fault_point(point: str, round_: int | None = None) -> None:
    """Fail here, as `STARLING_FAULT` says, if it names this point (and this round)."""
    if point not in POINTS:  # a caller's typo is a bug, found by the first test that passes here
        raise ValueError(f"unknown fault point {point!r}")
    _armed.hit(point, round_)
