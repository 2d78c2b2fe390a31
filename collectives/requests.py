"""A request that waits out a peer whose protocol is not up yet, within a round's deadline."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from starling.collectives.bodies.fields import BodyError
from starling.node.loop import AwakeDeadline
from starling.node.rpc import NoHandlerError, NoSocketError, Refusal, Refuser, RequestTimeout, refusal

if TYPE_CHECKING:
    from starling.node import Node
    from starling.node.wire import Message


async def request_patiently(node: Node, peer: str, topic: str, body: Any, payload: Sequence[Any],
                            deadline: AwakeDeadline, retry_s: float) -> Message:
    """A request within `deadline` (the loop's awake time: a reply read late because this loop
    was stalled still counts), retried every `retry_s` while the peer has no handler for the
    topic yet (its protocol is not up), or while every socket this node may open is busy
    (another request's reply frees one). Raises RequestTimeout, or what the request raised."""
    while True:
        try:
            if deadline.expired():
                raise asyncio.TimeoutError
            return await deadline.wait(node.arequest(peer, topic, body, payload,
                                                     timeout_s=max(deadline.wall_left(), 0.01)))
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply from {peer} to {topic!r} within the round's time") from None
        except (NoHandlerError, NoSocketError):
            if deadline.left <= retry_s:
                raise
            await deadline.sleep(retry_s)


class AskBudget:
    """How many of one kind of ask each member may have answered per round: `take(member, t)`
    counts one and says whether it was within `per_round`. The oldest (member, round) counts
    are forgotten first, past `kept` of them."""

    def __init__(self, per_round: int, kept: int = 1 << 14) -> None:
        self.per_round, self.kept = per_round, kept
        self._asked: dict[tuple[str, int], int] = {}

    def take(self, member: str, t: int) -> bool:
        key = (member, t)
        if self._asked.get(key, 0) >= self.per_round:
            return False
        self._asked[key] = self._asked.get(key, 0) + 1
        while len(self._asked) > self.kept:
            self._asked.pop(next(iter(self._asked)))
        return True

    def clear(self) -> None:
        """Forget every count."""
        self._asked.clear()


def member_ask(msg: Message, parse: Callable[[Any], Any], resolve_view: Callable[[bytes], tuple[str, ...] | None],
               refuse: Refuser, what: str) -> tuple[Any, tuple[str, ...]] | dict[str, Any]:
    """An ask about a round, parsed by `parse` (a body's `from_wire`, which names the round's
    member list by digest in `view`), and that list, if the sender is on it; else the refusal to
    answer (a dict). A malformed body or an asker not on the list is bad input, counted; a list
    unknown here is no one's fault (views change). `what`: what only members may do."""
    try:
        ask = parse(msg.body)
    except BodyError as exc:
        return refuse(Refusal.MALFORMED, str(exc))
    members = resolve_view(ask.view)
    if members is None:
        return refusal(Refusal.NOT_FOUND, "no member list of that digest here")
    if msg.sender not in members:
        return refuse(Refusal.MALFORMED, f"only the round's members {what}")
    return ask, members
