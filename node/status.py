"""What a node reports about itself: `Node.status()`, its table and counters as plain data
(what `starling node status` prints), and the answer to `$status`, which asks for it.

Asked from outside the swarm, the answer is no bigger than a multiple of the request
(`AdmissionConfig.stranger_reply_factor`): a bigger one is answered with the size to pad the
request to, so a stranger pays for its answer with its own upload. A member's status comes in
pages, charged to the pull budget its table pulls share (`node.table_sync`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack

from starling.node import rpc
from starling.node.admission import AdmissionConfig
from starling.node.dispatch import Dispatcher
from starling.node.hello import PeerVersions
from starling.node.local import LocalPeer
from starling.node.membership import PeerTable
from starling.node.outbox import Outbox
from starling.node.relay import Relay
from starling.node.stats import NodeStats
from starling.node.swarm import Swarm
from starling.node.transport import Inbound
from starling.node.trust import Trust
from starling.node.wire import ENVELOPE_BYTES, RejectReason, WireError, frame_nbytes

STATUS = "$status"


class NodeStatus:
    """A node's status, read from its parts; `address` and `info` are the node's own (its join
    address once started, what `Node.set_status_info` set)."""

    def __init__(self, local: LocalPeer, table: PeerTable, stats: NodeStats, outbox: Outbox, swarm: Swarm,
                 relay: Relay, trust: Trust, admission: AdmissionConfig, *, address: Callable[[], str],
                 info: Callable[[], dict[str, Any]]) -> None:
        self._local = local
        self._table = table
        self._stats = stats
        self._outbox = outbox
        self._swarm = swarm
        self._relay = relay
        self._trust = trust
        self._admission = admission
        self._address = address
        self._info = info

    def register(self, dispatch: Dispatcher) -> None:
        """Answer `$status`, to strangers too."""
        dispatch.on_internal_request(STATUS, self.answer, public=True)

    def status(self, peers: bool = True) -> dict[str, Any]:
        """Peer table and counters as plain data (what `starling node status` prints); with
        `peers` False, all but the table."""
        now = time.monotonic()
        local, transport = self._local, self._outbox.transport
        record = local.record
        status = {
            "id": local.peer_id, "address": self._address(), "security": local.mode.value,
            "version": PeerVersions.local().to_wire(),
            "reachable": record is not None and record.reachable, "relay": bool(record and record.relay),
            "listening": transport is not None and transport.listening,
            "config": local.swarm_config, "meta": dict(local.meta), "info": dict(self._info()),
            "stats": self._stats.snapshot(),
            "zap_denied": self.zap_denied,
            "sockets": self.socket_counts(),
            "relaying": self._relay.status(),
            "trust": self._trust.status(),
            "claims": self._swarm.claims.status(now),
        }
        if peers:
            status["peers"] = [{**p.summary(), "last_seen_s": round(now - p.last_seen, 3)} for p in self._table.all()]
        return status

    def socket_counts(self) -> dict[str, int]:
        """Open DEALERs against the cap, how many the cap made us open over the node's life,
        how many sends found every socket up to the cap's ceiling busy, how many peers'
        endpoints ZeroMQ refused to dial, how many could not open for lack of descriptors, and
        how many idle ones were closed to make room."""
        t = self._outbox.transport
        if t is None:
            return {}
        return {"open": t.open_dealers, "cap": t.dealer_cap, "opened": t.dealers_opened,
                "refused": t.dealers_refused, "connect_failures": t.connect_failures,
                "exhausted": t.exhausted, "shed": t.dealers_shed}

    @property
    def zap_denied(self) -> int:
        """Connections the allowlist refused (in the ZAP handler, before any message)."""
        policy = self._local.policy
        return policy.denied_count if policy else 0

    def answer(self, inbound: Inbound, member: str | None, body: Any) -> dict[str, Any]:
        """`status()` for `$status`. Asked from outside the swarm (`starling node status`), the
        answer is at most `stranger_reply_factor` times the request's bytes: a bigger status is
        answered with `{"pad_to": n}`, and the asker sends the request again padded to n bytes
        (`{"pad": bytes}`; `node.client.query` does), paying for its answer with its own upload.
        A member's status comes in pages out of its pull budget (`_member_status`)."""
        padded = isinstance(body, dict) and set(body) == {"pad"} and isinstance(body["pad"], bytes)
        paging = (member is not None and isinstance(body, dict) and set(body) == {"after"}
                  and isinstance(body["after"], str) and len(body["after"]) <= 64)
        if body is not None and not padded and not paging:
            raise WireError(RejectReason.BAD_FIELD, "status body must be empty, {pad: bytes} or, from a member, "
                            "{after: peer id}", field="body")
        if member is not None:
            return self._member_status(member, body["after"] if paging else None)
        status = self.status()
        factor = self._admission.stranger_reply_factor
        size = len(msgpack.packb(status, use_bin_type=True, default=str)) + ENVELOPE_BYTES
        if size <= factor * frame_nbytes(inbound.frames):
            return status
        return {"pad_to": size // factor + size // (4 * factor) + ENVELOPE_BYTES}  # a quarter to spare

    def _member_status(self, member: str, after: str | None) -> dict[str, Any]:
        """A member's `$status`, paged: the first page is the node's summary and the peers that
        fit in `table_page_bytes`, each later one (`{after: id}`) the next peers, and `next` the
        id to go on from (None at the end). Every page is charged to the member's pull budget,
        which its `$sync` pages and `$want` answers share: past it a page is turned down as busy
        (the refusal charged too), and a member that pulls on deep in debt is not answered."""
        admission, now = self._admission, time.monotonic()
        bucket = self._swarm.tables.pull_bucket(member, now)
        available = bucket.available(now)
        if available < -admission.table_page_bytes:
            raise rpc.Unanswered(f"{member} pulls status pages on past its budget's refusals")
        busy = rpc.BusyError(f"table pulls over {admission.member_pull_bytes_per_s:.0f} bytes/s; try again later")
        if available <= ENVELOPE_BYTES:  # turned down before any page is built (the refusal charged too)
            bucket.charge(ENVELOPE_BYTES, now)
            raise busy
        summary: dict[str, Any] = {}
        if after is None:
            summary = self.status(peers=False)
            if self._packed_size(summary) > admission.member_pull_burst_bytes // 2:
                # counters of more peers than a burst holds: their totals only, or never answered
                stats = summary["stats"]
                summary["stats"] = {k: v for k, v in stats.items() if k not in ("bytes_sent", "bytes_received")}
        budget = min(admission.table_page_bytes, available) - self._packed_size(summary)
        peers, following = self._peer_page(after, budget)
        if budget < 0 or (not peers and following is not None and after is not None):
            bucket.charge(ENVELOPE_BYTES, now)  # pulling faster only puts the next page further off
            raise busy
        answer = {**summary, "peers": peers, "next": following}
        bucket.charge(self._packed_size(answer), now)
        return answer

    @staticmethod
    def _packed_size(answer: dict[str, Any]) -> int:
        return len(msgpack.packb(answer, use_bin_type=True, default=str)) + ENVELOPE_BYTES

    def _peer_page(self, after: str | None, budget: int) -> tuple[list[dict[str, Any]], str | None]:
        """The summaries of the table's peers with ids above `after`, in id order, that fit in
        `budget` bytes, and the id to go on from (None when none are left)."""
        now = time.monotonic()
        entries = sorted((p for p in self._table.all() if after is None or p.peer_id > after), key=lambda p: p.peer_id)
        page: list[dict[str, Any]] = []
        nbytes = 0
        for p in entries:
            summary = {**p.summary(), "last_seen_s": round(now - p.last_seen, 3)}
            nbytes += len(msgpack.packb(summary, use_bin_type=True, default=str))
            if nbytes > budget:
                return page, page[-1]["id"] if page else after or ""
            page.append(summary)
        return page, None
