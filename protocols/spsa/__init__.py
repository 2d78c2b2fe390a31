"""Shared-seed SPSA: peers exchange one byte per projected gradient and replay each other's
perturbations from seeds.

- `protocol`: the `spsa` protocol (its step, reading like the algorithm box);
- `arith`: exact perturbation on a power-of-two grid and the one-byte code;
- `records`: the step records every peer keeps and replays;
- `leader`: the sequencer that orders contributions into records.
"""
from __future__ import annotations

from starling.protocols.spsa.protocol import Spsa, SpsaConfig

__all__ = ["Spsa", "SpsaConfig"]
