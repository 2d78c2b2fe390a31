"""`NodeConfig`: everything a node is configured by, one frozen value with a part for each
of its parts (liveness, sockets, frames, blobs, admission, relays, the peer table) and the
timeouts of joining, requests and leaving."""
from __future__ import annotations

from dataclasses import dataclass, field

from starling.node.admission import AdmissionConfig
from starling.node.membership import TableLimits
from starling.node.relay_config import RelayConfig
from starling.node.swim import Liveness
from starling.node.transfer import TransferConfig
from starling.node.transport import TransportConfig
from starling.node.wire import Limits


@dataclass(frozen=True)
class NodeConfig:
    liveness: Liveness = field(default_factory=Liveness)
    transport: TransportConfig = field(default_factory=TransportConfig)
    limits: Limits = field(default_factory=Limits)
    transfer: TransferConfig = field(default_factory=TransferConfig)  # serving and fetching blobs
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # bounds on work others cause
    relay: RelayConfig = field(default_factory=RelayConfig)
    offer_relay: bool = True  # a reachable node forwards sealed messages between clients
    reach_timeout_s: float = 2.0  # how long a dial-back to a joiner may take (see swarm.REACH)
    request_timeout_s: float = 10.0
    join_timeout_s: float = 10.0  # how long a first hello waits for its answer (each round twice the last)
    # Rounds over the join addresses, with backoff and jitter between them, until this has passed
    # (see Bootstrap.join): a seed that is restarting, busy or slow to answer does not fail a join.
    join_deadline_s: float = 30.0
    join_backoff_s: float = 1.0  # the first wait between two rounds (doubled each round, up to 30 s)
    # After a hello, page the rest of the seed's table from where its answer stopped (`next`).
    # False where something else hands the node the table (a simulator pulls the seed's table once
    # per process and gives every node it runs the records): 1024 nodes joining through one seed
    # and paging its table take a million records out of that seed's process.
    page_table_on_join: bool = True
    rejoin_interval_s: float = 10.0  # how often join addresses whose peers are gone are tried again
    leave_timeout_s: float = 1.0
    forget_after_s: float = 60.0  # dead/left peers are dropped from the table after this
    table: TableLimits = field(default_factory=TableLimits)  # how many peers the table holds, and per relayer
    # members whose word it takes to ban a peer without evidence any peer can check (node.trust):
    # more than the colluding liars a swarm should survive
    ban_witnesses: int = 2
    # peers whose bytes the node's counters keep apart (`NodeStats`, by peer and topic); past
    # them, bytes are summed under `OTHERS`, totals and per-topic counts staying exact. Two small
    # dicts a peer, about 0.4 KB: a simulator running thousands of nodes counts only totals.
    stats_peers: int = 1024
