"""starling.protocols: training algorithms, registered by name."""
from __future__ import annotations

from starling.protocols.base import (
    LossFn, Protocol, ProtocolConfig, ProtocolError, StepReport, get_protocol, register, registered_protocols,
)

__all__ = ["LossFn", "Protocol", "ProtocolConfig", "ProtocolError", "StepReport", "get_protocol",
           "register", "registered_protocols"]
