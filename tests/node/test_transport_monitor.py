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
