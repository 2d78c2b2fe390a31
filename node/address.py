"""Join and listen addresses.

A join address is a ZeroMQ endpoint plus, optionally, the peer's CurveZMQ public key:
``tcp://HOST:PORT#KEY``, ``ipc:///path#KEY``, ``inproc://name#KEY``. KEY is the raw 32-byte
X25519 public key in unpadded urlsafe base64 (43 characters); z85 is not used because its
alphabet contains ``#``.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "TRANSPORTS",
    "AddressError",
    "PeerAddress",
    "decode_key",
    "encode_key",
    "is_loopback",
    "parse_address",
    "parse_bind",
    "parse_record_endpoint",
    "resolve_endpoint",
]

TRANSPORTS = ("tcp", "ipc", "inproc")
KEY_BYTES = 32
_ENCODED_KEY_CHARS = 43
_KEY_ALPHABET = re.compile(r"^[A-Za-z0-9_-]+$")
_HOSTNAME_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_MAX_ENDPOINT_CHARS = 1024
# A unix socket path holds at most 107 bytes (sockaddr_un's 108, with the NUL): ZeroMQ refuses a
# longer ipc path when it binds or connects.
_MAX_IPC_PATH_BYTES = 107


class AddressError(ValueError):
    """An address that cannot be used; the message names what is wrong."""


def encode_key(raw: bytes) -> str:
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) != KEY_BYTES:
        raise AddressError(f"a curve key must be {KEY_BYTES} raw bytes")
    return base64.urlsafe_b64encode(bytes(raw)).decode("ascii").rstrip("=")


def decode_key(text: str) -> bytes:
    if not isinstance(text, str):
        raise AddressError("a curve key must be a string")
    if len(text) != _ENCODED_KEY_CHARS or not _KEY_ALPHABET.match(text):
        raise AddressError(
            f"curve key {text!r} must be {_ENCODED_KEY_CHARS} characters of unpadded "
            "urlsafe base64"
        )
    try:
        raw = base64.urlsafe_b64decode(text + "=")
    except (binascii.Error, ValueError):
        raise AddressError(f"curve key {text!r} is not valid urlsafe base64") from None
    if len(raw) != KEY_BYTES or encode_key(raw) != text:
        raise AddressError(f"curve key {text!r} does not encode {KEY_BYTES} bytes canonically")
    return raw


@dataclass(frozen=True)
class PeerAddress:
    endpoint: str  # the zmq endpoint, e.g. "tcp://127.0.0.1:5555"
    curve_key: bytes | None = None  # raw 32-byte X25519 public key

    @property
    def transport(self) -> str:
        return self.endpoint.split("://", 1)[0]

    def __str__(self) -> str:
        if self.curve_key is None:
            return self.endpoint
        return f"{self.endpoint}#{encode_key(self.curve_key)}"


def parse_address(text: str) -> PeerAddress:
    """Parse a join address ``ENDPOINT[#KEY]``; wildcards are refused."""
    if not isinstance(text, str):
        raise AddressError(f"address must be a string, got {type(text).__name__}")
    endpoint, sep, key_text = text.strip().partition("#")
    key: bytes | None = None
    if sep:
        if not key_text:
            raise AddressError(f"address {text!r}: empty curve key after '#'")
        try:
            key = decode_key(key_text)
        except AddressError as exc:
            raise AddressError(f"address {text!r}: {exc}") from None
    return PeerAddress(endpoint=_check_endpoint(endpoint, text, bind=False), curve_key=key)


def start_endpoints(listen: str | Sequence[str] | None, advertise: str | Sequence[str] | None,
                    join: Sequence[str]) -> tuple[list[str], list[str], list[PeerAddress]]:
    """What a node is started with, checked (`Node.start`): the endpoints it binds, those it
    advertises, and the addresses it joins through. One that listens nowhere must join."""
    listens = [parse_bind(x) for x in ([] if listen is None else [listen] if isinstance(listen, str) else listen)]
    if not listens and not join:
        raise ValueError("a node that listens nowhere must join a swarm (give a join address)")
    adverts = [] if advertise is None else [advertise] if isinstance(advertise, str) else list(advertise)
    # a record names IPs (`parse_record_endpoint`): an advertised name is resolved here, once
    adverts = [resolve_endpoint(parse_address(a).endpoint) for a in adverts]
    return listens, adverts, [parse_address(a) for a in join]


def parse_record_endpoint(text: str) -> str:
    """An endpoint a peer record names, as it came from the wire: it must parse as a join
    address without a key and already be in its canonical form (a record is signed as it is,
    so nothing is rewritten). AddressError otherwise."""
    address = parse_address(text)
    if address.curve_key is not None or address.endpoint != text:
        raise AddressError(f"record address {text!r} is not a canonical endpoint (it would read as "
                           f"{address.endpoint!r})")
    host = tcp_host(address.endpoint)
    if host is not None and not _is_ip(host):
        # every node that reads the record would look the name up, through ZeroMQ's I/O thread,
        # again on every reconnect: whoever signed it would choose what all of them wait on
        raise AddressError(f"record address {text!r}: a record names IP addresses, not host names "
                           "(a node resolves the name it advertises before it signs its record)")
    return address.endpoint


def parse_bind(text: str) -> str:
    """Parse a listen endpoint; tcp host may be ``*`` and port ``*`` or 0 (ephemeral)."""
    if not isinstance(text, str):
        raise AddressError(f"bind address must be a string, got {type(text).__name__}")
    text = text.strip()
    if "#" in text:
        raise AddressError(f"bind address {text!r}: a listen endpoint takes no curve key")
    return _check_endpoint(text, text, bind=True)


def is_loopback(endpoint: str) -> bool:
    """True when the endpoint can only be reached from this machine. Resolves nothing."""
    try:
        scheme, rest = endpoint.split("#", 1)[0].split("://", 1)
    except (ValueError, AttributeError):
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    try:
        host, _port = _split_host_port(rest, endpoint)
    except AddressError:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve_endpoint(endpoint: str) -> str:
    """A tcp endpoint with a host name, written with the first address the name resolves to
    (IPv4 first); any other endpoint as it is. AddressError if the name does not resolve."""
    host = tcp_host(endpoint)
    if host is None or _is_ip(host):
        return endpoint
    port = endpoint.rsplit(":", 1)[1]
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise AddressError(f"address {endpoint!r}: cannot resolve {host!r}: {exc}") from None
    ips = sorted({info[4][0] for info in infos}, key=lambda ip: (":" in ip, ip))
    if not ips:
        raise AddressError(f"address {endpoint!r}: {host!r} resolves to no address")
    return f"tcp://[{ips[0]}]:{port}" if ":" in ips[0] else f"tcp://{ips[0]}:{port}"


def tcp_host(endpoint: str) -> str | None:
    """The host of a tcp endpoint (without IPv6 brackets); None for ipc, inproc or a malformed one."""
    scheme, sep, rest = endpoint.split("#", 1)[0].partition("://")
    if scheme != "tcp" or not sep:
        return None
    try:
        return _split_host_port(rest, endpoint)[0]
    except AddressError:
        return None


# -- helpers ----------------------------------------------------------------------------


def _check_endpoint(endpoint: str, original: str, *, bind: bool) -> str:
    kind = "bind address" if bind else "address"
    if not endpoint:
        raise AddressError(f"{kind} {original!r} is empty")
    if len(endpoint) > _MAX_ENDPOINT_CHARS:
        raise AddressError(f"{kind} is longer than {_MAX_ENDPOINT_CHARS} characters")
    if any(ch.isspace() or ord(ch) < 0x20 for ch in endpoint):
        raise AddressError(f"{kind} {original!r} contains whitespace or control characters")
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise AddressError(
            f"{kind} {original!r} has no scheme; expected tcp://, ipc:// or inproc://"
        )
    if scheme not in TRANSPORTS:
        raise AddressError(
            f"{kind} {original!r}: unsupported scheme {scheme!r} (use tcp, ipc or inproc)"
        )
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise AddressError(f"{kind} {original!r}: empty {scheme} path")
        if scheme == "ipc" and not bind and rest == "*":
            raise AddressError(f"{kind} {original!r}: wildcard ipc path is not a join address")
        if scheme == "ipc" and len(rest.encode()) > _MAX_IPC_PATH_BYTES:
            raise AddressError(f"{kind} {original!r}: an ipc path holds at most {_MAX_IPC_PATH_BYTES} bytes")
        return f"{scheme}://{rest}"
    host, port_text = _split_host_port(rest, original)
    _check_host(host, original, bind=bind)
    port = _check_port(port_text, original, bind=bind)
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


_ZONE = re.compile(r"[A-Za-z0-9._-]{1,15}")  # a network interface name (IFNAMSIZ - 1) or index


def _split_host_port(rest: str, original: str) -> tuple[str, str]:
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise AddressError(f"address {original!r}: unclosed '[' in IPv6 host")
        host, after = rest[1:close], rest[close + 1 :]
        if not after.startswith(":"):
            raise AddressError(f"address {original!r}: missing ':PORT' after IPv6 host")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"address {original!r}: {host!r} is not an IPv6 address") from None
        zone = host.partition("%")[2]
        if "%" in host and not _ZONE.fullmatch(zone):
            raise AddressError(f"address {original!r}: an IPv6 zone is an interface name of 1 to 15 characters")
        return host, after[1:]
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise AddressError(f"address {original!r}: tcp address needs HOST:PORT")
    if ":" in host:
        raise AddressError(f"address {original!r}: an IPv6 host must be written in [brackets]")
    return host, port


def _check_host(host: str, original: str, *, bind: bool) -> None:
    if not host:
        raise AddressError(f"address {original!r}: empty tcp host")
    if host == "*":
        if bind:
            return
        raise AddressError(
            f"address {original!r}: '*' is a listen wildcard, not a host one can join"
        )
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        if not bind and ip.is_unspecified:
            raise AddressError(f"address {original!r}: {host} means 'every interface' to a listener; "
                               "it is not a host one can reach (give the peer's own address)")
        if ip.is_multicast:
            raise AddressError(f"address {original!r}: {host} is a multicast address, not a peer's")
        return
    if re.fullmatch(r"[0-9.]+", host):
        raise AddressError(f"address {original!r}: {host!r} is not a valid IPv4 address")
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_HOSTNAME_LABEL.match(label) for label in labels):
        raise AddressError(f"address {original!r}: {host!r} is not a valid hostname")


def _check_port(port_text: str, original: str, *, bind: bool) -> int | str:
    if bind and port_text == "*":
        return "*"
    if not port_text.isascii() or not port_text.isdigit():
        raise AddressError(f"address {original!r}: port {port_text!r} is not a number")
    if len(port_text) > 5:
        raise AddressError(f"address {original!r}: port {port_text!r} is out of range 1..65535")
    port = int(port_text)
    if port == 0 and bind:
        return 0
    if not 1 <= port <= 65535:
        raise AddressError(f"address {original!r}: port {port} is out of range 1..65535")
    return port
