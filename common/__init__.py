"""starling.common: the floor every room stands on, importing nothing from the others.

It holds what several rooms need done the same way, once:

- `config_from_options`, `parse_options`: options as NAME=VALUE text or typed values, into a
  frozen config dataclass (protocols, tasks and the CLI all read options through these);
- `derive_seed`: a 63-bit seed for one purpose, from a root seed and integers;
- `peer_hash`: a stable integer from a peer id (data shards, gossip partners, SPSA keys).
"""
from __future__ import annotations

from .hashing import derive_seed, peer_hash
from .options import coerce_option, config_from_options, option_name, parse_bool, parse_options, split_option

__all__ = [
    "coerce_option",
    "config_from_options",
    "derive_seed",
    "option_name",
    "parse_bool",
    "parse_options",
    "peer_hash",
    "split_option",
]
