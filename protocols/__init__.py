"""starling.protocols: training algorithms, registered by name."""
from __future__ import annotations

# Importing a protocol module registers it by name.
from starling.protocols import allreduce, diloco, gossip, sketch_dp, spsa  # noqa: F401
from starling.protocols.base import (
    PRIVATE_STATE,
    DivergedError,
    LossFn,
    Protocol,
    ProtocolConfig,
    ProtocolError,
    StepReport,
    config_from_options,
    get_protocol,
    register,
    registered_protocols,
)

__all__ = [
    "PRIVATE_STATE", "DivergedError", "LossFn", "Protocol", "ProtocolConfig", "ProtocolError", "StepReport",
    "config_from_options", "get_protocol", "register", "registered_protocols",
]
