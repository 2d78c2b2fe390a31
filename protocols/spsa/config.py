"""`spsa`'s options (`SpsaConfig`), each checked when the config is made: a bad one is refused
in one line naming it, before a node starts."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from starling.compressors import from_spec
from starling.protocols.base import ProtocolConfig
from starling.protocols.spsa.arith import Z_MAX

DIRECTIONS = ("shared", "per-peer")


def _changes_nothing(spec: str) -> bool:
    """Whether `spec` names a lossless codec: spsa sends no tensor, so that is the only kind of
    compressor it can accept without ignoring what the user asked for."""
    try:
        return from_spec(spec).lossless
    except ValueError:
        return False


@dataclass(frozen=True)
class SpsaConfig(ProtocolConfig):
    lr: float = 1e-3
    round_timeout_s: float = 10.0
    eps: float = 1e-3  # perturbation size
    directions: str = "shared"  # shared: one z per (step, sample) | per-peer: one per peer too
    samples: int = 1  # directions each peer evaluates (and codes it sends, in one message) per step
    distribution: str = "rademacher"  # rademacher | normal
    seed: int = 0  # the swarm seed every direction derives from
    digest_every: int = 16  # drift guard: compare parameter digests every this many steps
    param_filter: str = ""  # regex on parameter names; "" trains every trainable parameter
    g_scale: float = 1.0  # the one-byte code's initial scale (it then follows |g|)
    log_steps: int = 1024  # closed steps each peer keeps for joiners to replay
    chunk_numel: int = 1 << 18  # directions are regenerated this many values at a time
    eval_forwards: bool = True  # run the loss in eval mode (no dropout noise between L+ and L-)
    reply_grace_s: float = 2.0  # a contributor waits round_timeout_s + this for the record
    retry_interval_s: float = 0.05  # re-send to a leader whose protocol is not up yet

    def __post_init__(self) -> None:
        if self.directions not in DIRECTIONS:
            raise ValueError(f"directions must be 'shared' or 'per-peer', got {self.directions!r}")
        if self.distribution not in Z_MAX:
            raise ValueError(f"distribution must be 'rademacher' or 'normal', got {self.distribution!r}")
        if not _changes_nothing(self.compressor):
            raise ValueError(f"compressor: spsa codes gradients in one byte, takes none, got {self.compressor!r}")
        positive = ("eps", "g_scale", "round_timeout_s", "reply_grace_s", "retry_interval_s")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr!r}")
        for name in ("samples", "digest_every", "log_steps", "chunk_numel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        try:
            re.compile(self.param_filter)
        except re.error as exc:
            raise ValueError(f"param_filter {self.param_filter!r} is not a regex: {exc}") from None
