"""The hello: what a joiner says to the peer it joins through (the seed), and what it hears back.

A hello is a map, so that a later release can add keys (a peer ignores keys it does not know):

    {"record": the joiner's signed record, "config": the swarm config it insists on (or None),
     "table": whether it wants the table (a member's re-announce does not),
     "version": {"package": "0.2.0", "wire": [2, 2], "capabilities": ["relay", ...]},
     "turned_away": how many busy answers this join has had so far}

The answer is a map too: `{"record", "config", "peers", "next", "version"}`. Each side checks
the other's wire range against its own (`PeerVersions.meets`) before it takes anything from the
other; where the ranges do not meet, the seed refuses with `rpc.IncompatibleError` and the joiner
stops with `IncompatibleVersionError` (`node.bootstrap`), each in one line naming both sides'
versions and which side to upgrade (`mismatch_text`), and neither side's state changes.

Release 0.1.x (wire 1) sent the hello as the list `[record, config, want_table]`, and its seeds
refuse a map with a bad request naming that shape (`LEGACY_HELLO_REFUSAL`). A seed of this
release refuses such a list with a config conflict, the code a 0.1.x joiner stops on at once,
carrying the one line; a joiner of this release reads the 0.1.x seed's refusal as a seed on an
older wire.

A seed that is busy (its loop fell behind, or the hello went over its admission's caps) turns
the hello away with `rpc.BusyError`, whose `data` names a few other live members by their signed
records (`{"members": [...]}`), within what a stranger's answer may cost; the joiner checks each
record's signature and greets those members next. A joiner turned away `MAX_TURNED_AWAY` times
is taken by a seed that is merely behind: turned away by everyone, it would never join.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from starling.node.version import CAPABILITIES, PACKAGE_VERSION, WIRE_RANGE, wire_text
from starling.node.wire import RejectReason, WireError

MAX_PACKAGE_CHARS = 64
MAX_CAPABILITIES = 32
MAX_CAPABILITY_CHARS = 32
MAX_WIRE_VERSION = 1 << 16
MAX_TURNED_AWAY = 2  # busy answers after which a seed whose loop is behind takes the hello anyway
# The refusal a 0.1.x seed answers a hello of another shape with (a bad request, its only text).
LEGACY_HELLO_REFUSAL = "hello body must be [record, config, want_table]"
_PACKAGE_TEXT = re.compile(r"[0-9A-Za-z.+_-]+")  # shown to people: no control characters, no spaces


def _bad(what: str, field: str = "body") -> WireError:
    return WireError(RejectReason.BAD_FIELD, f"hello: {what}", field=field)


@dataclass(frozen=True)
class PeerVersions:
    """What one peer says of its build: its package version, the wire versions it speaks
    (oldest, newest), and its capabilities."""

    package: str
    wire: tuple[int, int]
    capabilities: tuple[str, ...] = ()

    @classmethod
    def local(cls) -> PeerVersions:
        """This build's."""
        return cls(PACKAGE_VERSION, WIRE_RANGE, CAPABILITIES)

    def meets(self, other: PeerVersions) -> bool:
        """Whether the two speak a wire version in common."""
        return max(self.wire[0], other.wire[0]) <= min(self.wire[1], other.wire[1])

    def text(self) -> str:
        return f"starling {self.package} ({wire_text(self.wire)})"

    def to_wire(self) -> dict[str, Any]:
        return {"package": self.package, "wire": list(self.wire), "capabilities": list(self.capabilities)}

    @classmethod
    def from_wire(cls, obj: Any) -> PeerVersions:
        """Parse and check a peer's versions; raises WireError (BAD_FIELD). Keys this release
        does not know are ignored."""
        if not isinstance(obj, dict):
            raise _bad("version must be a map", "version")
        package, wire, caps = obj.get("package"), obj.get("wire"), obj.get("capabilities", [])
        if not isinstance(package, str) or not 0 < len(package) <= MAX_PACKAGE_CHARS \
                or not _PACKAGE_TEXT.fullmatch(package):
            raise _bad(f"package version must be 1 to {MAX_PACKAGE_CHARS} characters of [0-9A-Za-z.+_-]", "version")
        if (not isinstance(wire, list) or len(wire) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_WIRE_VERSION
                           for v in wire) or wire[0] > wire[1]):
            raise _bad("wire must be [oldest, newest], 0 < oldest <= newest", "version")
        if (not isinstance(caps, list) or len(caps) > MAX_CAPABILITIES
                or not all(isinstance(c, str) and 0 < len(c) <= MAX_CAPABILITY_CHARS for c in caps)):
            raise _bad(f"capabilities must be at most {MAX_CAPABILITIES} names of 1 to {MAX_CAPABILITY_CHARS} "
                       "characters", "version")
        return cls(package, (wire[0], wire[1]), tuple(caps))


# What a hello or an answer without versions comes from: a peer of release 0.1.x.
LEGACY = PeerVersions("0.1.x", (1, 1))


def mismatch_text(seed: PeerVersions, joiner: PeerVersions) -> str:
    """The one line both sides say when their wire ranges do not meet."""
    older = "joiner" if joiner.wire[1] < seed.wire[0] else "seed"
    return f"the seed runs {seed.text()}; the joiner runs {joiner.text()}: upgrade the {older}"


@dataclass(frozen=True)
class Hello:
    """A `$hello` body. `record` stays raw: the seed checks it (allowlist, signature) only once
    the versions meet."""

    record: Any
    config: dict[str, Any] | None
    want_table: bool
    versions: PeerVersions
    turned_away: int = 0

    @classmethod
    def ours(cls, record: Any, config: dict[str, Any] | None = None, want_table: bool = True,
             turned_away: int = 0) -> Hello:
        """A hello from this build (its versions and capabilities)."""
        return cls(record, config, want_table, PeerVersions.local(), turned_away)

    @property
    def legacy(self) -> bool:
        """Sent by a 0.1.x peer, as `[record, config, want_table]`."""
        return self.versions is LEGACY

    def to_wire(self) -> dict[str, Any]:
        return {"record": self.record, "config": self.config, "table": self.want_table,
                "version": self.versions.to_wire(), "turned_away": self.turned_away}

    @classmethod
    def from_wire(cls, body: Any) -> Hello:
        """Parse a hello of this release or of 0.1.x; raises WireError (BAD_FIELD)."""
        if isinstance(body, list) and len(body) == 3 and isinstance(body[2], bool):
            config = body[1]
            return cls(body[0], config if isinstance(config, dict) else None, body[2], LEGACY)
        if not isinstance(body, dict):
            raise _bad("body must be a map {record, config, table, version}")
        versions = PeerVersions.from_wire(body.get("version"))
        config, table, turned = body.get("config"), body.get("table"), body.get("turned_away", 0)
        if config is not None and not isinstance(config, dict):
            raise _bad("swarm config must be a map", "config")
        if not isinstance(table, bool):
            raise _bad("table must be true or false")
        if not isinstance(turned, int) or isinstance(turned, bool) or not 0 <= turned <= MAX_WIRE_VERSION:
            raise _bad("turned_away must be a count")
        return cls(body.get("record"), config, table, versions, turned)


def reply_versions(body: dict[str, Any]) -> PeerVersions:
    """The versions a hello's answer carries; LEGACY for an answer without them."""
    raw = body.get("version")
    return LEGACY if raw is None else PeerVersions.from_wire(raw)


def busy_members(body: Any) -> list[Any]:
    """The raw member records a busy answer to a hello names (none if it names none)."""
    members = body.get("members") if isinstance(body, dict) else None
    return members if isinstance(members, list) else []
