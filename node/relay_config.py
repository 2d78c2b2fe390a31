"""`RelayConfig`: the bounds of relaying, in one place: what a relay forwards and queues
(`node.relay`), what a client names and keeps, the keys and replay windows of its sealer
(`node.relay_sealing`), and how long a relayed message waits for its acknowledgement
(`node.relay_delivery`)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RelayConfig:
    max_forwarding: int = 256  # forwards in flight at a relay; past it `$relay` is dropped
    max_relays: int = 3  # relays a client names in `$via`
    max_keys: int = 4096  # pair keys kept (derivation is an X25519 agreement plus HKDF); forgotten sources' marks
    replay_window: int = 4096  # nonces this far below a source's highest are refused
    max_queued_bytes: int = 16 << 20  # sealed bytes a relay has handed out for one client, not yet seen read
    max_queued_messages: int = 256  # messages of those (below ZeroMQ's 1000 a connection: a reader loses none)
    probe_interval_s: float = 0.25  # a probe unanswered this long is followed by another
    max_probes: int = 8  # probes awaiting an answer, per client
    # A relayed message unacknowledged after ack_timeout_s, plus a second per ack_bytes_per_s
    # of it, goes to the next relay (`node.relay_delivery`).
    ack_timeout_s: float = 2.0
    ack_bytes_per_s: float = 1e6
    max_unacked: int = 1024  # messages awaiting an acknowledgement; past it the oldest is given up
    max_unacked_bytes: int = 64 << 20
    drop_halflife_s: float = 60.0  # a relay's drops, as its senders count them, halve this often

    def __post_init__(self) -> None:
        for name in ("max_forwarding", "max_relays", "max_keys", "replay_window", "max_queued_bytes",
                     "max_queued_messages", "max_probes", "max_unacked", "max_unacked_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RelayConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("probe_interval_s", "ack_timeout_s", "ack_bytes_per_s", "drop_halflife_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"RelayConfig.{name} must be a finite number > 0, got {value!r}")
