"""libzmq's IO thread writes a socket's monitor events with a blocking send. A monitor whose
reading end could not be opened (the process was out of descriptors) must be stopped, or the
first event blocks the IO thread for good: no socket of the process reads, sends or accepts
again, while the node looks up."""
from __future__ import annotations

import asyncio
import errno
import socket
import threading

import pytest
import zmq
import zmq.asyncio

from starling.node.security import SecurityMode
from starling.node.transport import Inbound, Transport, TransportConfig


class _NoPairContext(zmq.asyncio.Context):
    """A context that cannot open PAIR sockets, as one out of descriptors cannot."""

    def socket(self, socket_type, *args, **kwargs):  # type: ignore[override]
        if socket_type == zmq.PAIR:
            raise zmq.ZMQError(errno.EMFILE)
        return super().socket(socket_type, *args, **kwargs)


def _hang_up_server(stop: threading.Event) -> int:
    """A TCP server that accepts every connection and closes it at once: a DEALER connected
    to it reconnects and disconnects every reconnect interval."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.close()
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


async def _io_thread_still_moves_messages() -> bool:
    context = _NoPairContext()
    stop = threading.Event()
    port = _hang_up_server(stop)

    async def receiver(inbound: Inbound) -> None:
        pass

    transport = Transport(context, mode=SecurityMode.PLAINTEXT, curve_public_z85=b"", curve_secret_z85=b"",
                          zap_domain="test", config=TransportConfig(reconnect_ivl_ms=20, reconnect_ivl_max_ms=20),
                          receiver=receiver)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RECONNECT_IVL, 20)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    router = context.socket(zmq.ROUTER)
    client = context.socket(zmq.DEALER)
    try:
        with pytest.raises(zmq.ZMQError):
            transport._monitor(dealer)
        await asyncio.sleep(0.5)  # the DEALER disconnects many times: each is an event
        router.setsockopt(zmq.LINGER, 0)
        client.setsockopt(zmq.LINGER, 0)
        port2 = router.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port2}")
        await client.send(b"still moving")
        try:
            frames = await asyncio.wait_for(router.recv_multipart(), 5.0)
        except asyncio.TimeoutError:
            return False
        return frames[-1] == b"still moving"
    finally:
        stop.set()
        for sock in (client, router, dealer):
            sock.close(0)
        await transport.close(0)
        # no term(): a context whose IO thread is blocked would never finish terminating


def test_a_monitor_without_a_reader_is_stopped_and_the_io_thread_goes_on() -> None:
    assert asyncio.run(_io_thread_still_moves_messages())


async def _watched_past_the_cap() -> dict[str, object]:
    """A transport with a cap of 2 that knows 4 peers (real ROUTERs on tcp): which of its
    DEALERs get a monitor, and whether a finger pinned while open hears its peer go."""
    context = zmq.asyncio.Context()
    routers = [context.socket(zmq.ROUTER) for _ in range(4)]
    dropped: list[str] = []

    async def receiver(inbound: Inbound) -> None:
        pass

    transport = Transport(context, mode=SecurityMode.PLAINTEXT, curve_public_z85=b"", curve_secret_z85=b"",
                          zap_domain="test", config=TransportConfig(max_open_dealers=2), receiver=receiver,
                          dropped=dropped.append)
    out: dict[str, object] = {}
    try:
        for i, router in enumerate(routers):
            router.setsockopt(zmq.LINGER, 0)
            port = router.bind_to_random_port("tcp://127.0.0.1")
            transport.connect(f"p{i}", [f"tcp://127.0.0.1:{port}"], None)
        # p0 and p1 opened as they were learned, with at most 2 peers known (under the cap:
        # watched); p2 and p3 found the cap full and open on their first send
        out["watched at first"] = sorted(transport._monitors)
        transport.pin(frozenset({"p3"}))  # p3 is not open: watched when it opens
        for i in (2, 3):
            await transport.send(f"p{i}", [b"hi"], timeout_s=5.0)
        out["open"] = sorted(transport._dealers)
        out["watched"] = sorted(transport._monitors)
        transport.pin(frozenset({"p3", "p2"}))  # p2 is open unwatched: watched from now on
        out["watched after pin"] = sorted(transport._monitors)
        await asyncio.sleep(0.3)  # the monitor's connection events settle
        routers[2].close(0)  # p2's process goes: its kernel closes the connection
        deadline = asyncio.get_running_loop().time() + 10.0
        while "p2" not in dropped and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        out["dropped"] = sorted(set(dropped))
    finally:
        await transport.close(0)
        for router in routers:
            router.close(0)
        context.term()
    return out


def test_past_the_cap_only_the_dealers_a_node_keeps_open_are_watched() -> None:
    """Past its cap a node's other DEALERs open for a send and close again; a monitor on each
    doubled the sockets it opened. The fingers it pins stay watched, also one pinned while
    already open, and hear their peer's connection drop."""
    out = asyncio.run(_watched_past_the_cap())
    assert out["watched at first"] == ["p0", "p1"]
    assert out["open"] == ["p2", "p3"]  # the cap closed p0 and p1 (and their monitors)
    assert out["watched"] == ["p3"]
    assert out["watched after pin"] == ["p2", "p3"]
    assert out["dropped"] == ["p2"]
