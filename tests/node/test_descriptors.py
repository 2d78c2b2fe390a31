"""A node that runs out of file descriptors sheds idle connections and goes on: a real process
whose descriptor limit is lowered after it starts, fed records by a member until its sockets
no longer fit."""
from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap

import zmq
from conftest import wait_until

from starling.node.client import ClientError, query
from starling.node.identity import Identity
from starling.node.membership import Liveness, PeerRecord
from starling.node.node import Node, NodeConfig
from starling.node.rpc import Reply
from starling.node.swarm import ANNOUNCE
from starling.node.transport import SendError

CHILD = textwrap.dedent("""
    import json, os, resource, sys
    from starling.node.swim import Liveness
    from starling.node.node import Node, NodeConfig
    from starling.node.transport import TransportConfig

    node = Node(config=NodeConfig(liveness=Liveness(probe_interval_s=1.0, suspicion_base_s=120.0),
                                  transport=TransportConfig(max_open_dealers=512))).start("tcp://127.0.0.1:0")
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(json.dumps({"address": node.address}), flush=True)
    def kinds():  # what holds this process's descriptors, for a failure's message
        out = {}
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:  # no descriptor left to list them with
            return {"none left to look": 1}
        for fd in fds:
            try:
                kind = os.readlink(f"/proc/self/fd/{fd}").split(":")[0].split("[")[0]
            except OSError:
                continue
            out[kind] = out.get(kind, 0) + 1
        return out

    for _ in sys.stdin:
        print(json.dumps({"fault": None if node.fault is None else str(node.fault), "closed": node.closed,
                          "sockets": node.status()["sockets"], "fds": kinds(), "limit": used + 40}), flush=True)
""")


def test_a_node_out_of_descriptors_sheds_idle_connections_and_stays_up():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    member = None
    try:
        address = json.loads(child.stdout.readline())["address"]

        def report() -> dict:
            child.stdin.write("\n")
            child.stdin.flush()
            return json.loads(child.stdout.readline())

        member = Node(config=NodeConfig(liveness=Liveness(probe_interval_s=1.0, suspicion_base_s=120.0))).start("tcp://127.0.0.1:0",
                                                                                     join=[address])
        endpoint = member.address.split("#")[0]  # something listens there: each DEALER holds a connection
        records = [PeerRecord.create(Identity.generate(), [endpoint], 1) for _ in range(120)]
        seed = member.live_peers()[0]
        for start in range(0, len(records), 10):
            try:
                member.run(member._asend_raw(seed, ANNOUNCE, [r.to_wire() for r in records[start:start + 10]]))
            except SendError:
                # The seed may be out of descriptors already, and then its connection to us can
                # drop with none left to take it again: the later batches wait out their timeout.
                # The first batches got through, or the wait below fails.
                break
        assert wait_until(lambda: report()["sockets"]["shed"] > 0, timeout_s=30)
        status = report()
        assert status["fault"] is None and not status["closed"], status

        errors: list[str] = []

        def answers() -> bool:
            try:
                return query(address, timeout_s=2)["id"] is not None
            except ClientError as exc:
                errors.append(str(exc))
                return False

        assert wait_until(answers, timeout_s=30), (errors[-3:], report())  # still serves, with descriptors to spare
    finally:
        if member is not None:
            member.close()
        child.kill()
        child.wait(30)


def test_a_monitor_whose_reader_cannot_be_opened_is_never_started(make_node):
    """Out of descriptors just as a DEALER's monitor needs its reading end: no monitor is
    started (none is then stopped: stopping one can block in libzmq), the DEALER is not opened,
    and the network thread goes on; the next send opens it, watched."""
    node = make_node("tcp")
    other = make_node("tcp", join=[node.address])
    other.on("echo", lambda m: Reply(m.body))
    assert wait_until(lambda: node.live_peers() == [other.peer_id])
    transport = node._transport

    async def open_without_a_pair():
        transport._close(other.peer_id, 0)
        cls = type(transport.context)
        real = cls.socket

        def no_pair(self, kind, *args, **kwargs):
            if kind == zmq.PAIR:
                raise zmq.ZMQError(errno.EMFILE)
            return real(self, kind, *args, **kwargs)

        cls.socket = no_pair
        try:
            transport._open_dealer(other.peer_id)
        except zmq.ZMQError as exc:
            return exc.errno
        finally:
            cls.socket = real
        return None

    assert node.submit(open_without_a_pair()).result(10) == errno.EMFILE
    assert node.run(_is_open(node, other.peer_id)) is False
    assert node.request(other.peer_id, "echo", 7).body == 7  # the next send opens it, watched


async def _is_open(node, peer_id):
    return node._transport.is_open(peer_id)
