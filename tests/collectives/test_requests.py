"""request_patiently: a round's request waits out a peer whose protocol is not up yet, and a
moment when every socket this node may open is busy, within the round's deadline."""
from __future__ import annotations

import asyncio
import time

import pytest
from conftest import TEST_LIVENESS, wait_until

from starling.collectives.requests import request_patiently
from starling.node import NodeConfig
from starling.node.loop import AwakeDeadline
from starling.node.rpc import NoSocketError
from starling.node.transport import TransportConfig


def test_a_request_that_finds_every_socket_busy_waits_for_one_to_free(make_node):
    # one socket to others, two while busy: two requests to slow peers hold both, and a third
    # request finds none until one of them is answered
    me = make_node("inproc", config=NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0,
                                               transport=TransportConfig(max_open_dealers=1)))
    others = [make_node("inproc", join=[me.address]) for _ in range(3)]
    for node in others:
        async def slow(msg, node=node):
            await asyncio.sleep(0.6)
            return {"from": node.peer_id}
        node.on("t.slow", slow)
    assert wait_until(lambda: len(me.live_peers()) == 3)
    busy_a, busy_b, third = (n.peer_id for n in others)

    async def scenario():
        held = [asyncio.ensure_future(me.arequest(p, "t.slow", {}, timeout_s=5.0)) for p in (busy_a, busy_b)]
        await asyncio.sleep(0.1)  # both sockets now wait on their replies
        with pytest.raises(NoSocketError, match="busy"):
            await me.arequest(third, "t.slow", {}, timeout_s=5.0)
        began = time.monotonic()
        reply = await request_patiently(me, third, "t.slow", {}, (), AwakeDeadline(5.0), 0.02)
        waited = time.monotonic() - began
        await asyncio.gather(*held)
        return reply, waited

    reply, waited = me.run(scenario())
    assert reply.body == {"from": third}
    assert waited > 0.3  # it waited for a socket (a reply at 0.6 s) and then took the slow answer
