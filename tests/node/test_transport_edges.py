"""libzmq's socket FD is edge-triggered: every zmq_send first processes the socket's pending
commands, which reads the edge. A raw send behind pyzmq's asyncio wrapper (heartbeats use
one, so that they never queue behind a blocked send) must therefore re-arm the wrapper,
also when that send fails, or a message that arrived meanwhile sits unread."""
from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from starling.node.security import SecurityMode
from starling.node.transport import Inbound, SendError, Transport, TransportConfig

BIG = b"x" * (1 << 20)


async def _arrives_after_a_raw_send(fail_raw_send: bool) -> bool:
    context = zmq.asyncio.Context()
    peer_context = zmq.Context()
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def receiver(inbound: Inbound) -> None:
        await got.put(bytes(inbound.frames[-1].bytes))

    transport = Transport(context, mode=SecurityMode.PLAINTEXT, curve_public_z85=b"", curve_secret_z85=b"",
                          zap_domain="test", config=TransportConfig(send_hwm=1, recv_hwm=1), receiver=receiver)
    router = peer_context.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 1)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        transport.connect("peer", [f"tcp://127.0.0.1:{port}"], None)
        await transport.send("peer", [b"hello"], timeout_s=10.0)
        route, hello = router.recv_multipart()  # learn the DEALER's routing id
        assert hello == b"hello"
        if fail_raw_send:  # fill the DEALER's queue and the kernel's: the router reads nothing more
            full_after_a_pause = 0
            for _ in range(2000):
                try:
                    await transport.send("peer", [BIG], wait=False)
                    full_after_a_pause = 0
                except SendError:
                    full_after_a_pause += 1
                    if full_after_a_pause == 4:
                        break
                    # let the I/O threads move what they still can; on a loaded box they are
                    # slow, and three short pauses once took a slow queue for a full one
                    await asyncio.sleep(0.6)
            else:
                pytest.fail("the DEALER's queue never filled")
        # Synchronously, so that the asyncio wrapper cannot react in between: a reply
        # arrives on the DEALER (its FD's edge), then a raw send processes the edge.
        router.send_multipart([route, b"reply"])
        time.sleep(0.3)
        try:
            await transport.send("peer", [b"ping"], wait=False)
            assert not fail_raw_send, "the queue should still be full"
        except SendError:
            assert fail_raw_send
        try:
            return await asyncio.wait_for(got.get(), 3.0) == b"reply"
        except asyncio.TimeoutError:
            return False
    finally:
        await transport.close(0)
        router.close(0)
        peer_context.term()
        context.term()


@pytest.mark.parametrize("fail_raw_send", [False, True], ids=["raw-send-succeeds", "raw-send-eagain"])
@pytest.mark.slow
def test_a_message_that_arrived_before_a_raw_send_is_read(fail_raw_send: bool) -> None:
    assert asyncio.run(_arrives_after_a_raw_send(fail_raw_send))


async def _send_while_its_socket_closes() -> tuple[type[BaseException] | None, str, float]:
    context = zmq.asyncio.Context()

    async def receiver(inbound: Inbound) -> None:
        pass

    transport = Transport(context, mode=SecurityMode.PLAINTEXT, curve_public_z85=b"", curve_secret_z85=b"",
                          zap_domain="test", config=TransportConfig(send_timeout_s=30.0), receiver=receiver)
    with zmq.Context() as free:  # a port that was free a moment ago; nothing accepts there now
        listener = free.socket(zmq.ROUTER)
        port = listener.bind_to_random_port("tcp://127.0.0.1")
        listener.close(0)
    try:
        transport.connect("peer", [f"tcp://127.0.0.1:{port}"], None)
        # No connection, and DEALERs queue nothing for a peer they are not connected to: the send waits.
        sending = asyncio.ensure_future(transport.send("peer", [b"hello"]))
        await asyncio.sleep(0.2)
        assert not sending.done()
        started = time.monotonic()
        transport.disconnect("peer")  # as a newer record of the peer, its death or its leave does
        try:
            await asyncio.wait_for(asyncio.shield(sending), 10.0)
            return None, "", time.monotonic() - started
        except (SendError, asyncio.CancelledError) as exc:
            return type(exc), str(exc), time.monotonic() - started
    finally:
        await transport.close(0)
        context.term()


def test_a_send_whose_socket_is_closed_under_it_fails_at_once_as_a_send() -> None:
    """pyzmq cancels the sends waiting on a socket it closes. The sender must see a failed
    send (which every caller handles), not a cancellation of its own task, and at once rather
    than after its timeout."""
    kind, message, took_s = asyncio.run(_send_while_its_socket_closes())
    assert kind is SendError, (kind, message)
    assert "closed" in message
    assert took_s < 5.0
