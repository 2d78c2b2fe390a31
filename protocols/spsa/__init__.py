"""Shared-seed SPSA: peers code each projected gradient in one byte and replay each other's
perturbations from seeds. A step's codes travel in one message per peer, so what a gradient
costs on the wire is about 1 + 34/samples bytes with 8 peers (the simulate summary's
`bytes_per_projected_gradient`): near one byte takes `samples` of 64 or more.

- `protocol`: the `spsa` protocol (its step, reading like the algorithm box);
- `config`: its options (`SpsaConfig`), checked when made;
- `arith`: exact perturbation on a power-of-two grid and the one-byte code;
- `records`: the step records every peer keeps and replays;
- `leader`: the sequencer that orders contributions into records.
"""
from __future__ import annotations

from starling.protocols.spsa.config import SpsaConfig
from starling.protocols.spsa.protocol import Spsa

__all__ = ["Spsa", "SpsaConfig"]
