"""What a node says about itself, in one place its parts read: its identity, how it secures
its sockets, its signed record, the swarm config it runs, the meta its beats carry, and
the allowlist it admits by.

The `Node` facade writes these (at start, in `set_meta`, when a join teaches it the swarm's
config) and shows them as its own attributes; the membership protocol, the bootstrap, the
relay and the dispatcher are given the one `LocalPeer` when the node builds them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starling.node.identity import Identity
from starling.node.membership import PeerRecord
from starling.node.security import SecurityMode, ZapPolicy


@dataclass
class LocalPeer:
    identity: Identity
    mode: SecurityMode = SecurityMode.PLAINTEXT
    record: PeerRecord | None = None  # signed at start, once the node knows whether it can be dialled
    swarm_config: dict[str, Any] | None = None
    # Replaced whole, never edited: the network thread may be packing the old one into a ping.
    meta: dict[str, Any] = field(default_factory=dict)
    policy: ZapPolicy | None = None  # the allowlist, under CURVE

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id
