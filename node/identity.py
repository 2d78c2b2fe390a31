"""A peer's identity: an Ed25519 keypair for signatures and an X25519 keypair for CurveZMQ.

The identity lives in a small JSON key file that only its owner may read (mode 0600). The
peer id is derived from the Ed25519 public key, so a peer cannot choose another's id.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from zmq.utils import z85

__all__ = [
    "KEY_FILE_FORMAT",
    "Identity",
    "KeyFileError",
    "peer_id_from_key",
    "verify_signature",
]

KEY_FILE_FORMAT = "starling-identity-v1"
_KEY_BYTES = 32
_SIGNATURE_BYTES = 64
_PEER_ID_DIGEST_BYTES = 10  # 80 bits -> 16 base32 characters

# Ed25519 points of small order (the y coordinates of the 8-torsion, plus their non-canonical
# encodings via the mod-p reduction). A key or signature R among them lets a signature verify
# for many messages, so, as libsodium does, we refuse them.
_P = 2**255 - 19
_Y_ORDER_8 = 0x7A03AC9277FDC74EC6CC392CFA53202A0F67100D760B3CBA4FD84D3D706A17C7
_SMALL_ORDER_Y = frozenset({0, 1, _P - 1, _Y_ORDER_8, _P - _Y_ORDER_8})

_RAW = serialization.Encoding.Raw
_RAW_PRIVATE = serialization.PrivateFormat.Raw
_RAW_PUBLIC = serialization.PublicFormat.Raw
_NO_ENCRYPTION = serialization.NoEncryption()


class KeyFileError(Exception):
    """A key file is missing, malformed, or readable by others. The message names the path."""


def peer_id_from_key(verify_key: bytes) -> str:
    """The peer id of an Ed25519 public key: lowercase unpadded base32 of sha256(key)[:10]."""
    if not isinstance(verify_key, (bytes, bytearray, memoryview)) or len(verify_key) != _KEY_BYTES:
        raise ValueError(f"verify_key must be {_KEY_BYTES} raw bytes")
    digest = hashlib.sha256(bytes(verify_key)).digest()[:_PEER_ID_DIGEST_BYTES]
    return base64.b32encode(digest).decode("ascii").rstrip("=").lower()


# Signatures this process has verified, by (key, signature, sha256 of what was signed): the
# nodes of a simulated box each verify the same signed statements (an owner's average goes to
# every member, a beat to every peer), 128 of them in a worker. The digest binds the statement
# as the signature does; only what verified is kept, the oldest dropped first.
_VERIFIED: dict[tuple[bytes, bytes, bytes], None] = {}
_KEEP_VERIFIED = 8192


def verify_signature(verify_key: bytes, data: bytes, signature: bytes) -> bool:
    """True if `signature` is `verify_key`'s Ed25519 signature of `data`; never raises."""
    try:
        if len(verify_key) != _KEY_BYTES or len(signature) != _SIGNATURE_BYTES:
            return False
        seen = (bytes(verify_key), bytes(signature), hashlib.sha256(data).digest())
        if seen in _VERIFIED:
            return True
        if _is_small_order(verify_key) or _is_small_order(signature[:32]):
            return False
        public = Ed25519PublicKey.from_public_bytes(seen[0])
        public.verify(seen[1], bytes(data))
        _VERIFIED[seen] = None
        if len(_VERIFIED) > _KEEP_VERIFIED:  # any thread may verify: each step is one operation on the dict
            _VERIFIED.pop(next(iter(_VERIFIED)), None)
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False
    except Exception:
        return False


def _is_small_order(encoded: bytes) -> bool:
    y = int.from_bytes(bytes(encoded), "little") & ((1 << 255) - 1)
    return y % _P in _SMALL_ORDER_Y


@dataclass(frozen=True)
class Identity:
    signing_key: Ed25519PrivateKey
    curve_secret: bytes  # raw 32-byte X25519 private key

    def __post_init__(self) -> None:
        if not isinstance(self.signing_key, Ed25519PrivateKey):
            raise TypeError("signing_key must be an Ed25519PrivateKey")
        if not isinstance(self.curve_secret, bytes) or len(self.curve_secret) != _KEY_BYTES:
            raise ValueError(f"curve_secret must be {_KEY_BYTES} raw bytes")

    @classmethod
    def generate(cls) -> Identity:
        curve = X25519PrivateKey.generate().private_bytes(_RAW, _RAW_PRIVATE, _NO_ENCRYPTION)
        return cls(signing_key=Ed25519PrivateKey.generate(), curve_secret=curve)

    @classmethod
    def from_seed(cls, seed: bytes | str) -> Identity:
        """The same identity for the same `seed`, every time: for reproducible simulations
        and tests only, since whoever knows the seed holds the keys. Peer ids decide shard
        ownership and the order in which owners sum, so a simulated swarm repeats bit for bit
        only if its peers keep their ids."""
        seed = seed.encode() if isinstance(seed, str) else bytes(seed)
        signing = hashlib.sha256(b"starling.identity.ed25519\0" + seed).digest()
        curve = hashlib.sha256(b"starling.identity.x25519\0" + seed).digest()
        return cls(signing_key=Ed25519PrivateKey.from_private_bytes(signing), curve_secret=curve)

    # -- keys ---------------------------------------------------------------------------

    @property
    def signing_secret(self) -> bytes:
        """Raw 32-byte Ed25519 private key (seed)."""
        return self.signing_key.private_bytes(_RAW, _RAW_PRIVATE, _NO_ENCRYPTION)

    @property
    def verify_key(self) -> bytes:
        return self.signing_key.public_key().public_bytes(_RAW, _RAW_PUBLIC)

    @property
    def curve_public(self) -> bytes:
        private = X25519PrivateKey.from_private_bytes(self.curve_secret)
        return private.public_key().public_bytes(_RAW, _RAW_PUBLIC)

    @property
    def curve_public_z85(self) -> bytes:
        return z85.encode(self.curve_public)

    @property
    def curve_secret_z85(self) -> bytes:
        return z85.encode(self.curve_secret)

    @functools.cached_property
    def peer_id(self) -> str:  # on every message's header: derive once
        return peer_id_from_key(self.verify_key)

    def sign(self, data: bytes) -> bytes:
        return self.signing_key.sign(bytes(data))

    def agree(self, curve_public: bytes) -> bytes:
        """The raw X25519 secret shared with the owner of `curve_public` (ValueError for a
        key that agrees on nothing: a small-order point gives all zeros)."""
        return X25519PrivateKey.from_private_bytes(self.curve_secret).exchange(
            X25519PublicKey.from_public_bytes(bytes(curve_public)))

    def __repr__(self) -> str:  # never print secrets
        return f"Identity(peer_id={self.peer_id!r})"

    # -- key file -----------------------------------------------------------------------

    def to_json(self) -> str:
        document = {
            "format": KEY_FILE_FORMAT,
            "peer_id": self.peer_id,
            "ed25519_private": self.signing_secret.hex(),
            "x25519_private": self.curve_secret.hex(),
        }
        return json.dumps(document, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str = "<key file>") -> Identity:
        try:
            document = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"{source}: not valid JSON ({exc})") from None
        if not isinstance(document, dict):
            raise KeyFileError(f"{source}: expected a JSON object")
        if document.get("format") != KEY_FILE_FORMAT:
            raise KeyFileError(
                f"{source}: unknown format {document.get('format')!r}, expected {KEY_FILE_FORMAT!r}"
            )
        ed = _hex_key(document, "ed25519_private", source)
        x = _hex_key(document, "x25519_private", source)
        identity = cls(signing_key=Ed25519PrivateKey.from_private_bytes(ed), curve_secret=x)
        recorded = document.get("peer_id")
        if recorded is not None and recorded != identity.peer_id:
            raise KeyFileError(
                f"{source}: peer_id {recorded!r} does not match the key (derives {identity.peer_id!r})"
            )
        return identity

    @classmethod
    def load(cls, path: str | os.PathLike) -> Identity:
        source = os.fspath(path)
        try:
            # O_NONBLOCK: a FIFO planted at the path must not hang the caller
            fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise KeyFileError(f"{source}: key file does not exist") from None
        except OSError as exc:
            raise KeyFileError(f"{source}: cannot open key file ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError(f"{source}: not a regular file")
            if st.st_mode & 0o077:
                raise KeyFileError(
                    f"{source}: key file is accessible by group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {source}`"
                )
            if st.st_size > 64 * 1024:
                raise KeyFileError(f"{source}: key file too large ({st.st_size} bytes)")
            with os.fdopen(fd, "rb", closefd=False) as handle:
                raw = handle.read()
        finally:
            os.close(fd)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise KeyFileError(f"{source}: key file is not UTF-8 text") from None
        return cls.from_json(text, source=source)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        target = os.fspath(path)
        data = self.to_json().encode("utf-8")
        if not overwrite:
            try:
                fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                raise KeyFileError(
                    f"{target}: key file already exists; pass overwrite=True to replace it"
                ) from None
            except OSError as exc:
                raise KeyFileError(f"{target}: cannot create key file ({exc.strerror})") from None
            try:
                _write_all(fd, data)
            except BaseException:
                os.close(fd)
                _unlink_quietly(target)
                raise
            os.close(fd)
            return
        directory = os.path.dirname(os.path.abspath(target))
        fd, temp = tempfile.mkstemp(prefix=".starling-key-", dir=directory)  # mkstemp uses 0600
        try:
            os.fchmod(fd, 0o600)
            _write_all(fd, data)
            os.close(fd)
            fd = -1
            os.replace(temp, target)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _unlink_quietly(temp)
            raise


def _hex_key(document: dict, name: str, source: str) -> bytes:
    value = document.get(name)
    if not isinstance(value, str):
        raise KeyFileError(f"{source}: field {name!r} is missing or not a string")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise KeyFileError(f"{source}: field {name!r} is not hex") from None
    if len(raw) != _KEY_BYTES:
        raise KeyFileError(f"{source}: field {name!r} must be {_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
    os.fsync(fd)


def _unlink_quietly(path: str) -> None:
    try:
        Path(path).unlink()
    except OSError:
        pass
