"""starling.protocols: training algorithms, registered by name."""
from __future__ import annotations

from starling.protocols.base import (
    LossFn, Protocol, ProtocolConfig, ProtocolError, StepReport, get_protocol, register, registered_protocols,
)

# Importing a protocol module registers it by name.
from starling.protocols import allreduce, diloco, gossip, sketch_dp, spsa  # noqa: E402,F401

__all__ = ["LossFn", "Protocol", "ProtocolConfig", "ProtocolError", "StepReport", "get_protocol",
           "register", "registered_protocols"]
