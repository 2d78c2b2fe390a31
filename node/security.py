"""Who may talk to a node: CurveZMQ keys, ZAP policies and the plaintext guard.

Every node listening with CURVE gets its own ZAP domain; one ZAP handler per process
(pyzmq's `zmq.auth`) dispatches each handshake to the policy of the node it targets.
The authenticated client key then rides on every inbound frame as ZeroMQ's
"User-Id" property, so a node can check that a message's claimed sender owns the
connection it came from.
"""
from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from starling.node.address import AddressError, PeerAddress, decode_key, is_loopback

log = logging.getLogger(__name__)


class SecurityError(Exception):
    """A configuration that would expose a node, or a bad allowlist file."""


class SecurityMode(str, enum.Enum):
    CURVE = "curve"  # encrypted and authenticated (default off inproc)
    PLAINTEXT = "plaintext"  # for simulations on one box; refused on public addresses


@dataclass
class ZapPolicy:
    """Accept any client key (open swarm) or only the keys in `allowed` (raw 32 bytes)."""

    allowed: frozenset[bytes] | None = None
    denied_count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def admits(self, curve_key: bytes) -> bool:
        """Whether a peer with this CURVE public key (raw 32 bytes) may be a member: checked
        for every record a node learns, first-hand or relayed, not only at the handshake."""
        return self.allowed is None or curve_key in self.allowed

    def callback(self, domain: str, client_key_z85: bytes) -> bool:
        if self.allowed is None:
            return True
        try:
            ok = z85.decode(client_key_z85) in self.allowed
        except Exception:  # malformed key from the handshake
            ok = False
        if not ok:
            with self._lock:
                self.denied_count += 1
            log.warning("ZAP denied a client key not in the allowlist (domain %s)", domain)
        return ok


def load_authorized_keys(path: str | Path) -> frozenset[bytes]:
    """Read an allowlist: one key per line (the part after '#' in a join address, or a
    whole join address), blank lines and lines starting with '//' or ';' ignored."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SecurityError(f"cannot read authorized keys file {p}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SecurityError(f"authorized keys file {p} is not text (byte {exc.start} is not UTF-8); "
                            "it holds one key or join address per line") from None
    keys: set[bytes] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("//", ";")):
            continue
        token = line.split()[0]
        if "://" in token:
            if "#" not in token:
                raise SecurityError(f"{p}:{lineno}: address has no key part after '#'")
            token = token.rsplit("#", 1)[1]
        try:
            keys.add(decode_key(token))
        except AddressError as exc:
            raise SecurityError(f"{p}:{lineno}: {exc}") from None
    return frozenset(keys)


def check_plaintext_allowed(endpoints: list[str], *, insecure: bool) -> None:
    """Plaintext is for one box: refuse it on any non-loopback endpoint unless insecure."""
    if insecure:
        return
    public = [e for e in endpoints if not is_loopback(e)]
    if public:
        raise SecurityError(
            f"refusing plaintext on non-loopback address {public[0]}: use CURVE "
            "(the default) or pass --insecure"
        )



def choose_security(listens: list[str], adverts: list[str], joins: list[PeerAddress],
                    security: SecurityMode | str | None, insecure: bool,
                    authorized_keys: str | Path | frozenset[bytes] | None,
                    ) -> tuple[SecurityMode, frozenset[bytes] | None]:
    """A node's security mode and allowlist from its start options, refusing combinations
    that would expose it: CURVE unless every listen endpoint is inproc; plaintext only on
    loopback (unless `insecure`); CURVE joins need the peer's key; an allowlist needs CURVE."""
    if security is None:
        # a client (no listen endpoint) goes by where it joins
        all_inproc = all(e.startswith("inproc://") for e in (listens or [j.endpoint for j in joins]))
        mode = SecurityMode.PLAINTEXT if all_inproc else SecurityMode.CURVE
    else:
        mode = SecurityMode(security)
    if mode is SecurityMode.PLAINTEXT:
        check_plaintext_allowed(listens + adverts + [j.endpoint for j in joins], insecure=insecure)
    else:
        if any(e.startswith("inproc://") for e in listens):
            raise SecurityError("CURVE does not apply to inproc endpoints; use security='plaintext'")
        missing = [str(j) for j in joins if j.curve_key is None]
        if missing:
            raise SecurityError(f"join address {missing[0]} has no '#KEY' part, which CURVE needs")
    if authorized_keys is None:
        return mode, None
    if mode is not SecurityMode.CURVE:
        raise SecurityError("an allowlist (authorized keys) needs CURVE security")
    if isinstance(authorized_keys, frozenset):
        return mode, authorized_keys
    return mode, load_authorized_keys(authorized_keys)

class ZapRegistry:
    """One ZAP handler per ZeroMQ context, dispatching on each node's domain."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self._context = context
        self._authenticator: AsyncioAuthenticator | None = None
        self._policies: dict[str, ZapPolicy] = {}

    def register(self, domain: str, policy: ZapPolicy) -> None:
        """Must be called from the network thread (the authenticator lives on its loop)."""
        if self._authenticator is None:
            self._authenticator = AsyncioAuthenticator(self._context, log=logging.getLogger(__name__ + ".zap"))
            self._authenticator.start()
        self._policies[domain] = policy
        self._authenticator.configure_curve_callback(domain, policy)

    def unregister(self, domain: str) -> None:
        self._policies.pop(domain, None)
        if self._authenticator is not None:
            self._authenticator.credentials_providers.pop(domain, None)
