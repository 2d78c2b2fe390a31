"""Reaching a swarm from addresses: the join, the dial-back that tells a joiner whether it can
be dialled, and the rejoin that heals a split swarm.

Joining is a hello to one known address, on a connection of its own, answered with the peer
table (records signed by their owners) and the swarm config; several addresses are tried in
turn, in rounds with backoff. Before its hello, a node that listens on TCP off loopback asks
the peer it joins through to dial it back (REACH): that peer opens a fresh connection to the
joiner's advertised addresses and asks for an ECHO of a nonce. An answer proves someone holding
the joiner's key listens there (under CURVE the dial-back authenticates the joiner's key);
silence means the joiner is behind a NAT or a firewall, and it joins as a client. As libp2p's
AutoNAT, the dial-back goes only to the IP the request came from (tcp, as ZeroMQ reports the
connection's peer): a stranger cannot make a node dial a third party, or probe whether
something listens there. The joiner asks from the IP it advertises, where that IP is its own. Every
`rejoin_interval_s`, join addresses whose peer is not alive to us are hello'd again: a seed that
restarted with an empty table, or the other half of a partition, learns our table and we learn
its own.
"""
from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import random
import socket
import time
from typing import Any

import zmq
from zmq.utils import z85

from starling.node import rpc
from starling.node.address import AddressError, PeerAddress, parse_address, tcp_host
from starling.node.dispatch import Dispatcher
from starling.node.local import LocalPeer
from starling.node.membership import MAX_ADDRESSES, PeerRecord, PeerTable
from starling.node.outbox import Outbox, Spawn
from starling.node.stats import NodeStats
from starling.node.swarm import HELLO, JoinError, Swarm, SwarmConfigError, config_conflict_text, config_conflicts
from starling.node.transport import Inbound
from starling.node.wire import Message, RejectReason, WireError

log = logging.getLogger(__name__)

REACH, ECHO = "$reach", "$echo"
MAX_DIALING = 8  # dial-backs in flight at once: each is a connection a stranger makes us open
MAX_NONCE = 64


class Bootstrap:
    """One node's way into a swarm from addresses. Lives on the network thread."""

    def __init__(self, local: LocalPeer, table: PeerTable, outbox: Outbox, swarm: Swarm, stats: NodeStats,
                 spawn: Spawn, *, join_attempts: int, join_backoff_s: float, join_timeout_s: float,
                 reach_timeout_s: float, rejoin_interval_s: float) -> None:
        self.local = local
        self.table = table
        self.outbox = outbox
        self.swarm = swarm
        self.stats = stats
        self.join_attempts = join_attempts
        self.join_backoff_s = join_backoff_s
        self.join_timeout_s = join_timeout_s
        self.reach_timeout_s = reach_timeout_s
        self.rejoin_interval_s = rejoin_interval_s
        self._spawn = spawn
        self._rng = random.Random()
        self.seeds: list[PeerAddress] = []  # the join addresses, tried again while their peers are gone
        self._bootstraps = itertools.count()
        self._dialing = 0
        self._last_rejoin = time.monotonic()

    def register(self, dispatch: Dispatcher) -> None:
        dispatch.on_internal_request(REACH, self.on_reach, public=True)
        dispatch.on_internal_request(ECHO, self.on_echo, public=True)

    def tick(self, now: float) -> None:
        """From the heartbeat loop: hello again to join addresses whose peers are gone."""
        if self.seeds and now - self._last_rejoin >= self.rejoin_interval_s:
            self._last_rejoin = now
            lost = [a for a in self.seeds if not self.seed_alive(a)]
            if lost:
                self._spawn(self._rejoin(lost))

    async def join(self, joins: list[PeerAddress]) -> None:
        """Join through the first address in `joins` that answers, trying them in turn, in
        rounds with exponential backoff (`join_attempts` rounds), so a swarm whose seed is
        restarting or a DNS name that is not yet up does not fail the join at once."""
        self.seeds = list(joins)
        errors: list[str] = []
        attempts = self.join_attempts
        for attempt in range(attempts):
            errors = []
            for address in joins:
                try:
                    await self._join_via(address.endpoint, address.curve_key)
                    return
                except SwarmConfigError:
                    raise
                except Exception as exc:  # try the next address
                    errors.append(f"{address}: {exc}")
            if attempt + 1 < attempts:
                delay = min(self.join_backoff_s * 2 ** attempt, 30.0)
                log.info("%s: no join address answered; trying again in %.1f s", self.local.peer_id, delay)
                await asyncio.sleep(delay * (0.5 + self._rng.random()))
        raise JoinError(f"could not join the swarm ({attempts} rounds): " + "; ".join(errors))

    async def _bootstrap_request(self, endpoint: str, curve_key: bytes | None, topic: str, body: Any,
                                 timeout_s: float) -> Message:
        """A request to an address, not to a peer of our table (a join, a dial-back), on a
        connection of its own that is closed after the answer."""
        transport = self.outbox.transport
        assert transport is not None
        handle = f"bootstrap-{next(self._bootstraps)}"
        transport.connect(handle, [endpoint], z85.encode(curve_key) if curve_key else None)
        try:
            return await self.outbox.request_on(handle, topic, body, timeout_s)
        except asyncio.TimeoutError:
            raise JoinError(f"no answer from {endpoint} within {timeout_s} s") from None
        finally:
            transport.disconnect(handle)

    async def reachable_via(self, joins: list[PeerAddress], endpoints: list[str]) -> bool | None:
        """Ask the first join address that answers whether it can dial us on `endpoints`;
        None if none answered (the join that follows fails and says why)."""
        source = _own_ip(endpoints)
        for address in joins:
            endpoint = address.endpoint
            if source is not None and tcp_host(endpoint) is not None:  # asked from the IP we advertise
                endpoint = f"tcp://{_bracketed(source)}:0;{endpoint.removeprefix('tcp://')}"
            try:
                reply = await self._bootstrap_request(endpoint, address.curve_key, REACH, [endpoints],
                                                      self.join_timeout_s)
            except Exception as exc:
                log.info("%s: reachability check via %s failed: %s", self.local.peer_id, address, exc)
                continue
            if isinstance(reply.body, dict) and isinstance(reply.body.get("reachable"), bool):
                return reply.body["reachable"]
        return None

    async def on_reach(self, inbound: Inbound, member: str | None, body: Any) -> dict[str, Any]:
        """Dial a would-be joiner back on the addresses it gives that are at the IP its request
        came from (bounded: few at a time); any other address is not dialled."""
        if (not isinstance(body, list) or len(body) != 1 or not isinstance(body[0], list)
                or not 0 < len(body[0]) <= MAX_ADDRESSES):
            raise WireError(RejectReason.BAD_FIELD, f"reach body must be [[1 to {MAX_ADDRESSES} addresses]]",
                            field="body")
        try:
            endpoints = [parse_address(a).endpoint for a in body[0]]
        except (AddressError, TypeError) as exc:
            raise WireError(RejectReason.BAD_FIELD, f"reach: {exc}", field="body") from None
        if self._dialing >= MAX_DIALING:
            raise rpc.BusyError(f"{self._dialing} dial-backs in flight")
        key = inbound.user_id.encode() if inbound.user_id else None
        self._dialing += 1
        try:
            endpoints = await self._at_requester(inbound, endpoints)
            if not endpoints:
                self.stats.count_rejected(RejectReason.REACH_ELSEWHERE.value)
                return {"reachable": False, "reason": "no tcp address at the IP this request came from"}
            for endpoint in endpoints:
                nonce = os.urandom(16)
                try:
                    reply = await self._bootstrap_request(endpoint, z85.decode(key) if key else None, ECHO, nonce,
                                                          self.reach_timeout_s)
                except Exception:
                    continue
                if reply.body == nonce:
                    return {"reachable": True, "endpoint": endpoint}
            return {"reachable": False}
        finally:
            self._dialing -= 1

    async def _at_requester(self, inbound: Inbound, endpoints: list[str]) -> list[str]:
        """The tcp endpoints among `endpoints` at the IP `inbound` came from, written with that IP
        (a name counts if it resolves to it, within the dial-back's timeout, and is dialled at
        that IP: ZeroMQ resolving the name again could get another answer)."""
        try:
            requester = _ip(inbound.frames[0].get("Peer-Address"))
        except (zmq.ZMQError, AttributeError):  # no such property (ipc, inproc)
            requester = None
        if requester is None:
            return []
        out = []
        for endpoint in endpoints:
            host = tcp_host(endpoint)
            if host is None:
                continue
            ip = _ip(host)
            if ip is None:
                try:
                    infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
                        host, None, type=socket.SOCK_STREAM), self.reach_timeout_s)
                except (OSError, asyncio.TimeoutError):
                    continue
                if requester not in {_ip(info[4][0]) for info in infos}:
                    continue
            elif ip != requester:
                continue
            out.append(f"tcp://{_bracketed(str(requester))}:{endpoint.rsplit(':', 1)[1]}")
        return out

    def on_echo(self, inbound: Inbound, member: str | None, body: Any) -> bytes:
        if not isinstance(body, bytes) or len(body) > MAX_NONCE:
            raise WireError(RejectReason.BAD_FIELD, f"echo body must be at most {MAX_NONCE} bytes", field="body")
        return body

    def _hello_body(self, want_table: bool = True) -> list[Any]:
        assert self.local.record is not None
        return [self.local.record.to_wire(), self.local.swarm_config, want_table]

    async def _join_via(self, endpoint: str, curve_key: bytes | None) -> None:
        """Hello to one known address; learn its table and config. The peer we joined
        announces us to the others; any it missed find us in the beats pings carry."""
        try:
            reply = await self._bootstrap_request(endpoint, curve_key, HELLO, self._hello_body(),
                                                  self.join_timeout_s)
        except rpc.ConfigConflictError as exc:
            raise SwarmConfigError(f"{endpoint}: {exc.detail}") from None
        except rpc.RemoteError as exc:
            raise JoinError(f"{endpoint}: {exc.detail}") from None
        responder = self._accept_hello_reply(reply.body)
        if curve_key is not None and responder.curve_key != curve_key:
            raise JoinError(f"{endpoint} answered with a record for a different key")
        following = reply.body.get("next")
        if isinstance(following, str):  # the table goes on past what a hello's answer may carry
            try:
                await self.swarm.sync(responder.peer_id, after=following)
            except Exception as exc:  # the digests' WANTs find the rest, only slower
                log.info("%s: could not page the table of %s: %s", self.local.peer_id, responder.peer_id, exc)

    def _accept_hello_reply(self, body: Any) -> PeerRecord:
        if not isinstance(body, dict) or not isinstance(body.get("peers"), list):
            raise JoinError("malformed hello reply")
        local = self.local
        config = body.get("config")
        if config is not None:
            if not isinstance(config, dict):
                raise JoinError("malformed swarm config in hello reply")
            if local.swarm_config is not None:
                conflicts = config_conflicts(config, local.swarm_config)
                if conflicts:
                    raise SwarmConfigError(config_conflict_text(conflicts))
            local.swarm_config = {**(local.swarm_config or {}), **config}
        responder = self.swarm.record_from(body.get("record"))
        self.swarm.learn(responder)
        # In a random order: a node opens sockets to the first peers it learns (up to its
        # cap), and in the table's order every joiner of a big swarm connected to the same
        # oldest peers, whose processes then held a connection from every peer.
        peers = list(body["peers"])
        self._rng.shuffle(peers)
        for raw in peers:
            try:
                self.swarm.learn(self.swarm.record_from(raw), told_by=responder.peer_id)
            except WireError as exc:
                self.stats.count_rejected(exc.reason.value)
        return responder

    def seed_alive(self, address: PeerAddress) -> bool:
        """Whether a join address belongs to us or to a peer alive to us."""
        local = self.local
        mine = local.record is not None and (address.endpoint in local.record.addresses
                                             or address.curve_key == local.identity.curve_public)
        return mine or any(address.curve_key == p.record.curve_key if address.curve_key is not None
                           else address.endpoint in p.record.addresses for p in self.table.live())

    async def _rejoin(self, lost: list[PeerAddress]) -> None:
        """Hello again to join addresses whose peers we lost (a partition, a seed that
        restarted): each side learns the other's table, and a swarm that split is one again."""
        for address in lost:
            try:
                await self._join_via(address.endpoint, address.curve_key)
                log.info("%s: rejoined through %s", self.local.peer_id, address)
            except Exception as exc:
                log.debug("%s: rejoin through %s failed: %s", self.local.peer_id, address, exc)


def _ip(text: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP from text, IPv4-mapped IPv6 as IPv4; None if it is no IP literal."""
    try:
        ip = ipaddress.ip_address(str(text).split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def _bracketed(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _own_ip(endpoints: list[str]) -> str | None:
    """The first IP among our advertised tcp endpoints that is one of this machine's own (it can
    be bound): the source our dial-back request is sent from, so that the peer dialling us back
    sees the IP we advertise. None if we advertise none of ours (a name, a forwarded port)."""
    for endpoint in endpoints:
        host = tcp_host(endpoint)
        ip = _ip(host) if host is not None else None
        if ip is None or ip.is_unspecified:
            continue
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((str(ip), 0))
        except OSError:
            continue
        return str(ip)
    return None
