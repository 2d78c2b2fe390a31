"""Reaching a swarm from addresses: the join, the dial-back that tells a joiner whether it can
be dialled, and the rejoin that heals a split swarm.

Joining is a hello to one known address, on a connection of its own, answered with the peer
table (records signed by their owners) and the swarm config (`node.hello` has the messages, and
the version check either side makes). Several addresses are tried in turn, in rounds with
exponential backoff and jitter and a patience that grows, until `join_deadline_s`: one slow or
busy seed does not fail a join. A seed too busy to take a hello names a few other members in
its refusal (`redirect`), and the joiner greets those next.

Before its hello, a node that listens on TCP off loopback asks
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
import contextlib
import ipaddress
import itertools
import logging
import math
import os
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
from zmq.utils import z85

from starling.node import rpc
from starling.node.address import AddressError, PeerAddress, is_loopback, parse_address, tcp_host
from starling.node.dispatch import Dispatcher
from starling.node.hello import (
    LEGACY,
    LEGACY_HELLO_REFUSAL,
    Hello,
    PeerVersions,
    busy_members,
    mismatch_text,
    reply_versions,
)
from starling.node.local import LocalPeer
from starling.node.membership import MAX_ADDRESSES, PeerRecord, PeerTable
from starling.node.outbox import Outbox, Spawn
from starling.node.security import SecurityMode
from starling.node.stats import NodeStats
from starling.node.swarm import HELLO, JoinError, Swarm, SwarmConfigError, config_conflict_text, config_conflicts
from starling.node.transport import Inbound
from starling.node.wire import Message, RejectReason, WireError, fitting

log = logging.getLogger(__name__)

REACH, ECHO = "$reach", "$echo"
MAX_DIALING = 8  # dial-backs in flight at once: each is a connection a stranger makes us open
MAX_NONCE = 64
MAX_BACKOFF_S = 30.0  # the longest wait between two rounds of hellos
MIN_PATIENCE_S = 1.0  # the least a hello waits for its answer (join_timeout_s, if that is less)
MAX_REDIRECTS = 4  # members a busy seed names in its refusal
MAX_NAMED = 16  # members named by busy seeds that a join keeps trying
REDIRECT_POOL_S = 1.0  # how long a busy seed reuses its list of members to name (a flood of hellos)


class IncompatibleVersionError(JoinError):
    """The seed and this node speak no wire version in common (`node.version`)."""


class _Refused(JoinError):
    """This seed will not take our hello, however often we ask (a bad request, a wrong key)."""


class _TurnedAway(JoinError):
    """The seed was too busy; `members` are the ones it named instead (signatures checked)."""

    def __init__(self, detail: str, members: list[PeerRecord]) -> None:
        super().__init__(detail)
        self.members = members


@dataclass(frozen=True)
class _Seed:
    """An address to hello: a join address, or a member that a busy seed named (then the
    answer must come from `peer_id`)."""

    endpoint: str
    curve_key: bytes | None
    peer_id: str | None = None
    label: str = ""

    def __str__(self) -> str:
        return self.label or self.endpoint


class Bootstrap:
    """One node's way into a swarm from addresses. Lives on the network thread."""

    def __init__(self, local: LocalPeer, table: PeerTable, outbox: Outbox, swarm: Swarm, stats: NodeStats,
                 spawn: Spawn, *, join_deadline_s: float, join_backoff_s: float, join_timeout_s: float,
                 reach_timeout_s: float, rejoin_interval_s: float, page_table: bool = True) -> None:
        self.local = local
        self.table = table
        self.outbox = outbox
        self.swarm = swarm
        self.stats = stats
        self.join_deadline_s = join_deadline_s
        self.join_backoff_s = join_backoff_s
        self.join_timeout_s = join_timeout_s
        self.reach_timeout_s = reach_timeout_s
        self.rejoin_interval_s = rejoin_interval_s
        self.page_table = page_table  # page the seed's table past its hello's answer (NodeConfig.page_table_on_join)
        self._spawn = spawn
        self._rng = random.Random()
        self.seeds: list[PeerAddress] = []  # the join addresses, tried again while their peers are gone
        self._seed_peers: dict[PeerAddress, str] = {}  # join address -> the live peer last found at it
        self._bootstraps = itertools.count()
        self._dialing = 0
        self._last_rejoin = time.monotonic()
        # a hello of ours is out: the join's own, or a rejoin's. Its seed is not in the table
        # until it answers, so the rejoin check waits: a join slower than `rejoin_interval_s`
        # (a busy seed, a loaded box) must not send the seed a second hello, and a second join's
        # worth of table, while the first is still queued there
        self._greeting = False
        self._pool: list[PeerRecord] = []  # members a busy seed names, sampled from (see `redirect`)
        self._pool_at = -math.inf

    def register(self, dispatch: Dispatcher) -> None:
        dispatch.on_internal_request(REACH, self.on_reach, public=True)
        dispatch.on_internal_request(ECHO, self.on_echo, public=True)
        dispatch.on_busy(HELLO, self.redirect)

    def tick(self, now: float) -> None:
        """From the probe loop, each period: hello again to join addresses whose peers are gone."""
        if self.seeds and not self._greeting and now - self._last_rejoin >= self.rejoin_interval_s:
            self._last_rejoin = now
            lost = [a for a in self.seeds if not self.seed_alive(a)]
            if lost:
                self._greeting = True
                self._spawn(self._rejoin(lost))

    async def join(self, joins: list[PeerAddress]) -> None:
        """Join through the first address in `joins` that takes our hello, trying them in turn
        (and the members a busy seed names, first), in rounds with exponential backoff and
        jitter until `join_deadline_s` has passed: a swarm whose seed is restarting or busy,
        or a DNS name that is not yet up, does not fail the join at once. Each round waits
        longer for an answer (twice the last, from `join_timeout_s`), for a seed whose loop is
        behind. A seed that refuses for good (a bad request, a wrong key) is dropped; a swarm
        whose config or wire versions this node cannot run fails the join at once."""
        self.seeds = list(joins)
        with self._hello_out():
            await self._join(joins)

    @contextlib.contextmanager
    def _hello_out(self) -> Iterator[None]:
        """While a hello of ours is out (the join's, or a rejoin's), the rejoin check waits; it
        counts its interval from when the hello ended."""
        self._greeting = True
        try:
            yield
        finally:
            self._greeting, self._last_rejoin = False, time.monotonic()

    async def _join(self, joins: list[PeerAddress]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.join_deadline_s
        seeds = [_Seed(a.endpoint, a.curve_key, label=str(a)) for a in joins]
        named: list[_Seed] = []  # members busy seeds named, newest first
        last: dict[str, str] = {}  # seed -> why its last hello failed
        dropped: set[_Seed] = set()
        hellos = turned_away = 0
        floor = min(self.join_timeout_s, MIN_PATIENCE_S)  # a hello given less than this is not sent
        for round_ in itertools.count():
            queue = [s for s in named + seeds if s not in dropped]
            timeout_s = self.join_timeout_s * 2 ** min(round_, 6)
            while queue and deadline - loop.time() >= floor:
                seed = queue.pop(0)
                hellos += 1
                try:
                    await self._join_via(seed, min(timeout_s, deadline - loop.time()), turned_away)
                    return
                except (SwarmConfigError, IncompatibleVersionError) as exc:
                    raise type(exc)(f"{seed}: {exc}") from None
                except _TurnedAway as exc:
                    turned_away += 1
                    last[str(seed)] = str(exc)
                    fresh = [m for m in self._named_seeds(exc.members) if m not in named and m not in dropped]
                    named = (fresh + named)[:MAX_NAMED]
                    queue = fresh + [s for s in queue if s not in fresh]
                except (_Refused, WireError) as exc:  # a seed that answers so will answer so again
                    dropped.add(seed)
                    last[str(seed)] = str(exc)
                except Exception as exc:  # no answer, a send that failed: try again later
                    last[str(seed)] = str(exc)
            left = deadline - loop.time()
            why = "; ".join(f"{seed}: {reason}" for seed, reason in last.items())
            if left < floor or all(s in dropped for s in named + seeds):
                within = f"within {self.join_deadline_s:g} s " if left < floor else ""
                raise JoinError(f"could not join the swarm {within}({hellos} hellos in {round_ + 1} rounds): {why}")
            delay = min(self.join_backoff_s * 2 ** round_, MAX_BACKOFF_S) * (0.5 + self._rng.random())
            delay = min(delay, left - floor)  # the last round still gets a hello's patience
            log.info("%s: could not join yet (%s); trying again in %.1f s (%.0f s left to join)",
                     self.local.peer_id, why, delay, left)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _named_seeds(self, members: list[PeerRecord]) -> list[_Seed]:
        """Members a busy seed named, as seeds to greet (not ourselves; each at its first address)."""
        curve = self.local.mode is SecurityMode.CURVE
        return [_Seed(r.addresses[0], r.curve_key if curve else None, r.peer_id, f"{r.peer_id} at {r.addresses[0]}")
                for r in members if r.peer_id != self.local.peer_id and r.reachable]

    def redirect(self, budget: int) -> dict[str, Any] | None:
        """What a busy answer to a hello carries (`Dispatcher.on_busy`): a few live members that
        can be dialled, at random, by their signed records, within `budget` bytes; None when
        none fits. The list sampled from is rebuilt once a second at most: a flood of hellos
        over this node's caps must not cost a walk of the table each."""
        now = time.monotonic()
        if now - self._pool_at >= REDIRECT_POOL_S:
            self._pool = [p.record for p in self.table.live() if p.record.reachable]
            self._pool_at = now
        chosen = self._rng.sample(self._pool, min(MAX_REDIRECTS, len(self._pool)))
        members, _ = fitting((record.to_wire() for record in chosen), budget - len(msgpack.packb({"members": []})))
        return {"members": members} if members else None

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
            raise JoinError(f"no answer from {endpoint} within {timeout_s:.3g} s") from None
        finally:
            transport.disconnect(handle)

    async def dialable(self, joins: list[PeerAddress], endpoints: list[str]) -> list[str]:
        """The endpoints a starting node signs into its record: `endpoints`, or none (a client)
        if the peer it joins through cannot dial it on them (`reachable_via`). Only TCP off
        loopback can be out of reach (inproc and ipc are this machine's)."""
        if any(e.startswith("tcp://") and not is_loopback(e) for e in endpoints):
            if await self.reachable_via(joins, endpoints) is False:
                log.warning("%s: the peer we join through cannot dial %s; joining as a client (reached over the "
                            "connections this node opens, and through relays)", self.local.peer_id,
                            ", ".join(endpoints))
                return []
        return endpoints

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

    def _hello_body(self, turned_away: int = 0) -> dict[str, Any]:
        assert self.local.record is not None
        return Hello.ours(self.local.record.to_wire(), self.local.swarm_config, True, turned_away).to_wire()

    async def _join_via(self, seed: _Seed, timeout_s: float, turned_away: int = 0) -> None:
        """Hello to one known address; learn its table and config. The peer we joined
        announces us to the others; any it missed find us in the beats pings carry."""
        try:
            reply = await self._bootstrap_request(seed.endpoint, seed.curve_key, HELLO,
                                                  self._hello_body(turned_away), timeout_s)
        except rpc.IncompatibleError as exc:
            raise IncompatibleVersionError(exc.detail) from None
        except rpc.ConfigConflictError as exc:
            raise SwarmConfigError(exc.detail) from None
        except rpc.BadRequestError as exc:
            if LEGACY_HELLO_REFUSAL in exc.detail:  # a 0.1.x seed: it knows no hello but its own
                raise IncompatibleVersionError(mismatch_text(LEGACY, PeerVersions.local())) from None
            raise _Refused(exc.detail) from None
        except rpc.BusyError as exc:
            raise _TurnedAway(f"busy: {exc.detail}", self._checked(busy_members(exc.data))) from None
        except rpc.RemoteError as exc:
            raise JoinError(exc.detail) from None
        responder = self._accept_hello_reply(reply.body, seed)
        following = reply.body.get("next")
        if isinstance(following, str) and self.page_table:  # the table goes on past what a hello's answer may carry
            try:
                await self.swarm.tables.sync(responder.peer_id, after=following)
            except Exception as exc:  # the digests' WANTs find the rest, only slower
                log.info("%s: could not page the table of %s: %s", self.local.peer_id, responder.peer_id, exc)

    def _checked(self, raws: list[Any]) -> list[PeerRecord]:
        """The member records a busy seed named whose signatures (and the allowlist) pass; a
        record that fails is counted and left out."""
        records = []
        for raw in raws[:MAX_REDIRECTS]:
            try:
                records.append(self.swarm.record_from(raw))
            except WireError as exc:
                self.stats.count_rejected(exc.reason.value)
        return records

    def _accept_hello_reply(self, body: Any, seed: _Seed) -> PeerRecord:
        """Check a hello's answer (versions first: nothing is taken from a seed we cannot talk
        to), then take its config and learn its table."""
        if not isinstance(body, dict) or not isinstance(body.get("peers"), list):
            raise _Refused("malformed hello reply")
        theirs, mine = reply_versions(body), PeerVersions.local()
        if not theirs.meets(mine):
            raise IncompatibleVersionError(mismatch_text(theirs, mine))
        local = self.local
        config = body.get("config")
        if config is not None and not isinstance(config, dict):
            raise _Refused("malformed swarm config in hello reply")
        responder = self.swarm.record_from(body.get("record"))
        if seed.curve_key is not None and responder.curve_key != seed.curve_key:
            raise _Refused("answered with a record for a different key")
        if seed.peer_id is not None and responder.peer_id != seed.peer_id:
            raise _Refused(f"answered with the record of {responder.peer_id}, not of the member named")
        if config is not None:
            if local.swarm_config is not None:
                conflicts = config_conflicts(config, local.swarm_config)
                if conflicts:
                    raise SwarmConfigError(config_conflict_text(conflicts))
            local.swarm_config = {**(local.swarm_config or {}), **config}
        log.debug("%s: %s runs %s, capabilities %s", local.peer_id, responder.peer_id, theirs.text(),
                  ", ".join(theirs.capabilities) or "none")
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
        """Whether a join address belongs to us or to a peer alive to us. The peer last found
        at an address is checked first: each period costs a table lookup per join address,
        not a pass over the table (a thousand peers' worth, for each of a thousand nodes)."""
        local = self.local
        if local.record is not None and (address.endpoint in local.record.addresses
                                         or address.curve_key == local.identity.curve_public):
            return True
        known = self._seed_peers.get(address)
        info = self.table.get(known) if known is not None else None
        if info is not None and info.peer_id in self.table.live_ids and _at(address, info.record):
            return True
        found = next((p.peer_id for p in self.table.live() if _at(address, p.record)), None)
        if found is None:
            self._seed_peers.pop(address, None)
            return False
        self._seed_peers[address] = found
        return True

    async def _rejoin(self, lost: list[PeerAddress]) -> None:
        """Hello again to join addresses whose peers we lost (a partition, a seed that
        restarted): each side learns the other's table, and a swarm that split is one again."""
        with self._hello_out():
            for address in lost:
                try:
                    await self._join_via(_Seed(address.endpoint, address.curve_key, label=str(address)),
                                         self.join_timeout_s)
                    log.info("%s: rejoined through %s", self.local.peer_id, address)
                except Exception as exc:
                    log.debug("%s: rejoin through %s failed: %s", self.local.peer_id, address, exc)


def _at(address: PeerAddress, record: PeerRecord) -> bool:
    """Whether `record` is the peer at `address`: its key, where the address names one, else
    one of its endpoints."""
    if address.curve_key is not None:
        return address.curve_key == record.curve_key
    return address.endpoint in record.addresses


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
