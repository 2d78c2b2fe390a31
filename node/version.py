"""Which starling this is, and what it speaks to other peers: the one home of its versions.

- The **package version** (`PACKAGE_VERSION`, semantic: `0.2.0`); pip's metadata takes it from
  here, so a stale install's metadata or a build directory cannot make a node misreport it.
- The **wire version** (`WIRE_VERSION`) numbers what the topics and their bodies mean. It goes
  up when a release changes them so that the release before cannot follow (the CHANGELOG's
  "Wire" section says what changed). A build speaks a range of them, `WIRE_RANGE = (min, max)`:
  each release talks to the one before it unless its changelog says the wire broke.
- The **envelope version** (`ENVELOPE_VERSION`, the header's `"v"`) numbers the framing of a
  message (`node.wire`). Every release so far frames messages alike, so that a peer of another
  release can still read the hello that tells it the two cannot talk.
- **Capabilities** name optional features a build has, for a peer to ask about before it relies
  on one; a peer ignores names it does not know.

A joiner says its versions and capabilities at hello and the peer it greets answers with its
own (`node.hello`); each side refuses a peer whose wire range does not meet its own, in one
line that names both sides and what to upgrade.
"""
from __future__ import annotations

__all__ = ["CAPABILITIES", "ENVELOPE_VERSION", "PACKAGE_VERSION", "WIRE_RANGE", "WIRE_VERSION", "describe", "wire_text"]

PACKAGE_VERSION = "0.2.0"  # pyproject.toml reads it from here: an installed copy cannot disagree
WIRE_VERSION = 2  # 2: membership is SWIM (0.2.0); 1: heartbeats in all-to-all digests (0.1.x)
WIRE_RANGE = (2, 2)  # the wire versions this build speaks, oldest first
ENVELOPE_VERSION = 1
# Optional features of this build, by the names peers use for them:
#   relay         forwards sealed messages between clients behind NAT (`node.relay`)
#   dial-back     answers `$reach`: tells a joiner whether it can be dialled (`node.bootstrap`)
#   signed-parts  signs and checks parts and averages of a sharded all-reduce (`collectives`)
#   accuse        takes and sends evidence against members over `$accuse` (`node.trust`)
#   busy-redirect turns a hello away when busy, naming other members to try (`node.hello`)
CAPABILITIES = ("relay", "dial-back", "signed-parts", "accuse", "busy-redirect")


def wire_text(wire: tuple[int, int]) -> str:
    """A wire range as people read it: "wire 2", or "wire 2-3"."""
    low, high = wire
    return f"wire {low}" if low == high else f"wire {low}-{high}"


def describe() -> str:
    """This build in one line: what `starling --version` prints."""
    return f"starling {PACKAGE_VERSION} ({wire_text(WIRE_RANGE)}; capabilities: {', '.join(CAPABILITIES)})"
