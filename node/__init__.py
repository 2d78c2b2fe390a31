"""starling.node: everything a peer process runs.

The public surface is `Node` (start, join, send, request, leave), the identity and address
helpers, and the typed errors of requests; the rest are the parts it is built from:

- `node`: the `Node` facade, configured by `config` (`NodeConfig`); `status`: what it reports
  of itself (`Node.status`, and the answer to `$status`);
- `rpc`: requests, their error codes (`ErrorCode`) and typed `RemoteError`s, the named
  reasons a handler refuses work for (`Refusal`, `refusal()`);
- `dispatch`: the inbound path (decode, authenticate, route to handlers, answer), within the
  bounds of `admission` (requests in flight per connection and per process, strangers' rates);
- `swarm`: the membership protocol (hello, SWIM probes and gossip, want, leave), over
  `membership`, the peer table, which holds the signed records and beats of `records`;
  `hello`: the hello's messages and the version check each side makes, from `version`, the
  one home of this build's versions;
- `transport` (its capped DEALERs in `dealers`), `wire`, `security`, `identity`, `address`: sockets,
  frames, CURVE, keys;
- `transfer`: blobs in digest-checked chunks; `loop`: the network thread and deadlines;
  `stats`: byte and rejection counters; `client`: one-shot queries from outside a swarm.
"""
from __future__ import annotations

from starling.node.address import PeerAddress, parse_address
from starling.node.identity import Identity, KeyFileError
from starling.node.membership import PeerStatus, PeerView
from starling.node.node import (
    IncompatibleVersionError,
    JoinError,
    Node,
    NodeConfig,
    NodeFault,
    SwarmConfigError,
    UnknownPeerError,
)
from starling.node.rpc import (
    BadRequestError,
    BusyError,
    ConfigConflictError,
    ErrorCode,
    HandlerError,
    IncompatibleError,
    NoHandlerError,
    Refusal,
    RefusedError,
    RemoteError,
    Reply,
    RequestTimeout,
    RpcError,
    refusal,
    refusal_of,
)
from starling.node.swim import Liveness
from starling.node.transfer import TransferConfig, TransferError
from starling.node.transport import TransportConfig
from starling.node.wire import Limits, Message, RejectReason, WireError

__all__ = [
    "BadRequestError", "BusyError", "ConfigConflictError", "ErrorCode", "HandlerError", "Identity",
    "IncompatibleError", "IncompatibleVersionError", "JoinError",
    "KeyFileError", "Limits", "Liveness", "Message", "NoHandlerError", "Node", "NodeConfig", "NodeFault", "PeerAddress",
    "PeerStatus", "PeerView", "Refusal", "RefusedError", "RejectReason", "RemoteError", "Reply", "RequestTimeout",
    "RpcError", "SwarmConfigError", "TransferConfig", "TransferError", "TransportConfig", "UnknownPeerError",
    "WireError", "parse_address", "refusal", "refusal_of",
]
