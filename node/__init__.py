"""starling.node: everything a peer process runs.

The public surface is `Node` (start, join, send, request, leave) plus the identity and
address helpers; the rest are the parts it is built from.
"""
from __future__ import annotations

from starling.node.address import PeerAddress, parse_address
from starling.node.identity import Identity, KeyFileError
from starling.node.membership import Liveness, PeerStatus, PeerView
from starling.node.node import JoinError, Node, NodeConfig, SwarmConfigError, UnknownPeerError
from starling.node.rpc import (
    BadRequestError,
    ConfigConflictError,
    ErrorCode,
    HandlerError,
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
from starling.node.transfer import TransferConfig, TransferError
from starling.node.transport import TransportConfig
from starling.node.wire import Limits, Message, RejectReason, WireError

__all__ = [
    "BadRequestError", "ConfigConflictError", "ErrorCode", "HandlerError", "Identity", "JoinError", "KeyFileError",
    "Limits", "Liveness", "Message", "NoHandlerError", "Node", "NodeConfig", "PeerAddress", "PeerStatus", "PeerView",
    "Refusal", "RefusedError", "RejectReason", "RemoteError", "Reply", "RequestTimeout", "RpcError",
    "SwarmConfigError", "TransferConfig", "TransferError", "TransportConfig", "UnknownPeerError", "WireError",
    "parse_address", "refusal", "refusal_of",
]
