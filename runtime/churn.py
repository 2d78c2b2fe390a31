"""Churn for simulated swarms: peers that crash, leave or join at given steps.

Churn spec grammar (comma-separated events; a STEP is the swarm's step count)::

    kill:RANK@STEP      peer RANK crashes after STEP steps: its node closes without a leave,
                        so the others find out through heartbeats
    leave:RANK@STEP     peer RANK leaves gracefully after STEP steps
    join@STEP           a new peer joins once some peer has done STEP steps; it fetches the
    join:COUNT@STEP     protocol state from a live peer and continues at that peer's step

Initial peers have ranks 0..peers-1; joiners get the next ranks in the order they join.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_EVENT = re.compile(r"(kill|leave):(\d+)@(\d+)|join(?::(\d+))?@(\d+)")


class ChurnSpecError(ValueError):
    """A churn spec could not be read or does not fit the simulation."""


@dataclass(frozen=True)
class ChurnEvent:
    kind: Literal["kill", "leave", "join"]
    step: int
    rank: int | None = None  # kill and leave
    count: int = 1  # join

    def __str__(self) -> str:
        if self.kind == "join":
            return f"join{'' if self.count == 1 else f':{self.count}'}@{self.step}"
        return f"{self.kind}:{self.rank}@{self.step}"


def parse_churn(spec: str) -> tuple[ChurnEvent, ...]:
    """Read "kill:1@50,join@80" (see the module doc for the grammar)."""
    events: list[ChurnEvent] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        match = _EVENT.fullmatch(part)
        if not match:
            raise ChurnSpecError(f"cannot read churn event {part!r}: expected kill:RANK@STEP, "
                                 "leave:RANK@STEP, join@STEP or join:COUNT@STEP")
        if match.group(1):
            events.append(ChurnEvent(match.group(1), int(match.group(3)), rank=int(match.group(2))))  # type: ignore[arg-type]
        else:
            count = int(match.group(4) or 1)
            if count < 1:
                raise ChurnSpecError(f"churn event {part!r}: join count must be >= 1")
            events.append(ChurnEvent("join", int(match.group(5)), count=count))
    return tuple(events)


def check_churn(events: tuple[ChurnEvent, ...], peers: int, steps: int) -> None:
    """Raise ChurnSpecError if an event names a peer that never exists or a step past the end."""
    world = peers + sum(e.count for e in events if e.kind == "join")
    stopped: set[int] = set()
    for event in events:
        if event.step >= steps:
            raise ChurnSpecError(f"churn event {event} is at step {event.step}, but the run has {steps} steps")
        if event.rank is not None:
            if event.rank >= world:
                raise ChurnSpecError(f"churn event {event} names peer {event.rank}; ranks run 0..{world - 1}")
            if event.rank in stopped:
                raise ChurnSpecError(f"churn spec stops peer {event.rank} twice")
            stopped.add(event.rank)
    if len(stopped) >= world:
        raise ChurnSpecError("churn spec stops every peer; at least one must finish")

