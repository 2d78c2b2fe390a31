"""The drift guard of the protocols whose peers hold the same state bit for bit: the
parameters of allreduce and sketch-dp, the outer parameters of DiLoCo.

    every check_every rounds t, after the update:
        same = agree(t, members, digest of my parameters)    # collectives/agreement.py
        if not same:                                          # every member reaches the same verdict
            the first member keeps a copy of its state for round t
            every other member fetches it ("<prefix>sync") and takes it, and logs that it did

Peers drift apart when they were built with different initial weights, or when a round went
on without an owner's average (its shard kept each peer's own values). The state taken is
whatever the protocol says (its parameters and optimizer state; DiLoCo's outer parameters and
momentum), so that the peers also step alike afterwards. A round that went on without a member
gives no verdict: the next check decides.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from starling.collectives import ReduceTimeouts
from starling.collectives.agreement import AgreementCheck
from starling.node.rpc import Refusal, Reply, refusal, refusal_of

if TYPE_CHECKING:
    from starling.node.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)

# A protocol's state as it travels: a msgpack-able header and tensors.
State = tuple[dict[str, Any], list[torch.Tensor]]


class DriftGuard:
    """Checks every `every` rounds that the members' `tensors()` agree; on a mismatch, every
    member but the first takes the first member's `snapshot()` through `adopt(header, tensors)`
    (which raises ValueError for a state it cannot take). Its logs call the tensors `what`."""

    def __init__(self, node: Node, prefix: str, every: int, timeouts: ReduceTimeouts, is_open: Callable[[], bool],
                 tensors: Callable[[], Sequence[torch.Tensor]], snapshot: Callable[[], State],
                 adopt: Callable[[dict[str, Any], list[torch.Tensor]], None], what: str = "parameters") -> None:
        self.node, self.every, self.timeouts, self._is_open, self.what = node, every, timeouts, is_open, what
        self._tensors, self._snapshot, self._adopt = tensors, snapshot, adopt
        self.check = AgreementCheck(node, f"{prefix}agree", timeouts, is_open)
        self.topic = f"{prefix}sync"
        # (round, my state then or None): the last verdict of mine, and what I serve for it
        self._served: tuple[int, State | None] = (-1, None)
        self.repairs = 0  # times this peer took another's state
        node.on(self.topic, self._on_sync)

    @property
    def reducer(self) -> Any:
        return self.check.reducer

    def due(self, t: int) -> bool:
        return self.every > 0 and t % self.every == 0

    def run(self, t: int, members: tuple[str, ...]) -> bool | None:
        """Round t's check (training thread, every member of the round at once): the verdict,
        after any repair."""
        same = self.check.agree(t, members, self._tensors())
        me, source = self.node.peer_id, members[0]
        if same is not False:
            self._served = (t, None)
            return same
        if source == me:
            self._served = (t, self._snapshot())
            log.warning("%s: %s differ across the swarm at round %d; the others take mine", me, self.what, t)
            return same
        self._served = (t, None)
        log.warning("%s: my %s differ from the swarm's at round %d; taking %s's", me, self.what, t, source)
        if self._fetch(t, source):
            self.repairs += 1
        else:
            log.warning("%s: could not take %s's state for round %d; checking again at the next check", me,
                        source, t)
        return same

    def _fetch(self, t: int, source: str) -> bool:
        """Ask `source` for its state of round t until it serves it, refuses for good, or the
        round's timeout (plus grace) has passed."""
        deadline = time.monotonic() + self.timeouts.round_timeout_s + self.timeouts.reply_grace_s
        while time.monotonic() < deadline:
            try:
                msg = self.node.request(source, self.topic, {"round": t},
                                        timeout_s=max(0.1, min(deadline - time.monotonic(), 10.0)))
            except Exception as exc:  # dead, or not serving yet: try until the deadline
                log.debug("%s: %s from %s failed: %s", self.node.peer_id, self.topic, source, exc)
            else:
                body = msg.body if isinstance(msg.body, dict) else {}
                if body.get("ok"):
                    try:
                        self._adopt(body.get("state") or {}, list(msg.payload))
                        return True
                    except (ValueError, TypeError, KeyError) as exc:
                        log.warning("%s: %s's state does not fit: %s", self.node.peer_id, source, exc)
                        return False
                if refusal_of(body) is not Refusal.BUSY:  # not "not yet": it will not serve it
                    log.info("%s: %s refused its state: %s", self.node.peer_id, source, body)
                    return False
            time.sleep(self.timeouts.retry_interval_s)
        return False

    def _on_sync(self, msg: Message) -> Reply | dict[str, Any]:
        """Network thread: my state as it was at the round of a mismatch, for the others."""
        if not self._is_open():
            return refusal(Refusal.CLOSED, "protocol closed")
        try:
            t = int(msg.body["round"])
        except (TypeError, KeyError, ValueError):
            return refusal(Refusal.MALFORMED, "body must be {round: int}")
        served_round, state = self._served
        if t > served_round:
            return refusal(Refusal.BUSY, f"no verdict for round {t} yet", step=served_round)
        if t < served_round:
            return refusal(Refusal.TOO_OLD, f"round {t} is past; the last check was {served_round}",
                           step=served_round)
        if state is None:
            return refusal(Refusal.NOT_FOUND, f"my verdict for round {t} was not a mismatch", step=served_round)
        return Reply({"ok": True, "round": t, "state": state[0]}, state[1])
