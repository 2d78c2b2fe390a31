from __future__ import annotations

import json
import os
import stat

import pytest
import zmq

from starling.node.identity import (
    Identity,
    KeyFileError,
    peer_id_from_key,
    verify_signature,
)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_generate_gives_raw_keys_of_the_right_size():
    identity = Identity.generate()
    assert len(identity.verify_key) == 32
    assert len(identity.curve_public) == 32
    assert len(identity.curve_secret) == 32
    assert len(identity.curve_public_z85) == 40
    assert len(identity.curve_secret_z85) == 40


def test_curve_keys_are_accepted_by_zmq():
    identity = Identity.generate()
    assert zmq.curve_public(identity.curve_secret_z85) == identity.curve_public_z85


def test_two_identities_differ():
    a, b = Identity.generate(), Identity.generate()
    assert a.peer_id != b.peer_id
    assert a.curve_public != b.curve_public


def test_from_seed_gives_the_same_working_keys_for_the_same_seed_only():
    a, again = Identity.from_seed("sim:0:1"), Identity.from_seed(b"sim:0:1")
    assert (a.peer_id, a.curve_secret, a.signing_secret) == (again.peer_id, again.curve_secret, again.signing_secret)
    other = Identity.from_seed("sim:0:2")
    assert other.peer_id != a.peer_id and other.curve_public != a.curve_public
    assert a.curve_secret != a.signing_secret  # the two keys come from separate derivations
    assert zmq.curve_public(a.curve_secret_z85) == a.curve_public_z85
    assert verify_signature(a.verify_key, b"data", a.sign(b"data"))
    assert Identity.from_json(a.to_json()).peer_id == a.peer_id


def test_peer_id_is_derived_from_the_verify_key():
    identity = Identity.generate()
    assert identity.peer_id == peer_id_from_key(identity.verify_key)
    assert len(identity.peer_id) == 16
    assert identity.peer_id == identity.peer_id.lower()
    assert set(identity.peer_id) <= set("abcdefghijklmnopqrstuvwxyz234567")


def test_peer_id_known_value():
    # sha256(32 zero bytes)[:10] in lowercase base32 without padding
    assert peer_id_from_key(bytes(32)) == "mzuhvlpymk6xo3ep"


def test_peer_id_rejects_wrong_key_length():
    with pytest.raises(ValueError):
        peer_id_from_key(b"short")


def test_sign_and_verify():
    identity = Identity.generate()
    signature = identity.sign(b"hello")
    assert len(signature) == 64
    assert verify_signature(identity.verify_key, b"hello", signature)


def test_tampered_data_or_signature_fails():
    identity = Identity.generate()
    signature = identity.sign(b"hello")
    assert not verify_signature(identity.verify_key, b"hellp", signature)
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify_signature(identity.verify_key, b"hello", flipped)
    other = Identity.generate()
    assert not verify_signature(other.verify_key, b"hello", signature)


def test_a_signature_verified_once_is_taken_again_and_nothing_near_it_is(monkeypatch):
    """What verified is kept (the nodes of a simulated box verify the same statements), by the
    key, the signature and the digest of what was signed: none of the three can change."""
    import starling.node.identity as identity_module

    monkeypatch.setattr(identity_module, "_VERIFIED", {})  # what earlier tests verified is not kept here
    calls = []  # the keys verified in full (other threads of this process may verify too)
    real = identity_module.Ed25519PublicKey.from_public_bytes
    monkeypatch.setattr(identity_module.Ed25519PublicKey, "from_public_bytes",
                        lambda key: calls.append(key) or real(key))
    identity, other = Identity.generate(), Identity.generate()
    data = b"an average of round 7" * 50
    signature = identity.sign(data)

    def checked() -> int:
        return calls.count(identity.verify_key)

    assert verify_signature(identity.verify_key, data, signature) and checked() == 1
    assert verify_signature(identity.verify_key, bytearray(data), signature) and checked() == 1  # from what it kept
    assert not verify_signature(identity.verify_key, data[:-1] + b"!", signature)
    assert not verify_signature(other.verify_key, data, signature)
    assert not verify_signature(identity.verify_key, data, bytes([signature[0] ^ 1]) + signature[1:])
    monkeypatch.setattr(identity_module, "_KEEP_VERIFIED", 4)  # bounded: the oldest go first
    for n in range(6):
        assert verify_signature(other.verify_key, b"%d" % n, other.sign(b"%d" % n))
    before = checked()
    assert verify_signature(identity.verify_key, data, signature) and checked() == before + 1  # checked anew


@pytest.mark.parametrize(
    "key, data, signature",
    [
        (b"", b"x", bytes(64)),
        (bytes(31), b"x", bytes(64)),
        (bytes(32), b"x", bytes(63)),
        (bytes(32), b"x", bytes(64)),
        (None, b"x", bytes(64)),
        (bytes(32), None, bytes(64)),
        (bytes(32), b"x", "not bytes"),
        (b"\xff" * 32, b"x", b"\xff" * 64),
    ],
)
def test_verify_never_raises(key, data, signature):
    assert verify_signature(key, data, signature) is False


def test_save_creates_0600_and_load_round_trips(tmp_path):
    path = tmp_path / "peer.key"
    identity = Identity.generate()
    identity.save(path)
    assert _mode(path) == 0o600
    loaded = Identity.load(path)
    assert loaded.peer_id == identity.peer_id
    assert loaded.verify_key == identity.verify_key
    assert loaded.curve_secret == identity.curve_secret
    assert loaded.curve_public == identity.curve_public
    document = json.loads(path.read_text())
    assert document["peer_id"] == identity.peer_id


def test_save_creates_0600_even_with_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "peer.key"
        Identity.generate().save(path)
    finally:
        os.umask(old)
    assert _mode(path) == 0o600


def test_save_refuses_to_overwrite(tmp_path):
    path = tmp_path / "peer.key"
    first = Identity.generate()
    first.save(path)
    with pytest.raises(KeyFileError, match="exists"):
        Identity.generate().save(path)
    assert Identity.load(path).peer_id == first.peer_id


def test_save_overwrite_replaces_and_stays_0600(tmp_path):
    path = tmp_path / "peer.key"
    Identity.generate().save(path)
    os.chmod(path, 0o644)
    second = Identity.generate()
    second.save(path, overwrite=True)
    assert _mode(path) == 0o600
    assert Identity.load(path).peer_id == second.peer_id
    assert [p.name for p in tmp_path.iterdir()] == ["peer.key"]  # no temp file left


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666, 0o610])
def test_load_refuses_group_or_other_access(tmp_path, mode):
    path = tmp_path / "peer.key"
    Identity.generate().save(path)
    os.chmod(path, mode)
    with pytest.raises(KeyFileError, match=str(path)):
        Identity.load(path)


def test_load_accepts_0400(tmp_path):
    path = tmp_path / "peer.key"
    identity = Identity.generate()
    identity.save(path)
    os.chmod(path, 0o400)
    assert Identity.load(path).peer_id == identity.peer_id


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.key"
    with pytest.raises(KeyFileError, match="does not exist"):
        Identity.load(path)


def _write_private(path, text: str) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def _valid_document() -> dict:
    return json.loads(Identity.generate().to_json())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: "not json at all",
        lambda d: "[1, 2, 3]",
        lambda d: json.dumps({**d, "format": "other"}),
        lambda d: json.dumps({k: v for k, v in d.items() if k != "ed25519_private"}),
        lambda d: json.dumps({k: v for k, v in d.items() if k != "x25519_private"}),
        lambda d: json.dumps({**d, "ed25519_private": "zz" * 32}),
        lambda d: json.dumps({**d, "x25519_private": "ab" * 31}),
        lambda d: json.dumps({**d, "ed25519_private": 12}),
        lambda d: json.dumps({**d, "peer_id": "aaaaaaaaaaaaaaaa"}),
        lambda d: "\udcff",
    ],
)
def test_load_malformed(tmp_path, mutate):
    path = tmp_path / "peer.key"
    text = mutate(_valid_document())
    if text == "\udcff":
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.write(fd, b"\xff\xfe\x00garbage")
        os.close(fd)
    else:
        _write_private(path, text)
    with pytest.raises(KeyFileError, match=str(path)):
        Identity.load(path)


def test_load_directory_is_refused(tmp_path):
    directory = tmp_path / "dir"
    directory.mkdir(mode=0o700)
    with pytest.raises(KeyFileError):
        Identity.load(directory)


def test_repr_hides_secrets():
    identity = Identity.generate()
    text = repr(identity)
    assert identity.peer_id in text
    assert identity.curve_secret.hex() not in text


def test_load_fifo_does_not_hang(tmp_path):
    path = tmp_path / "fifo.key"
    os.mkfifo(path, 0o600)
    with pytest.raises(KeyFileError, match="regular file"):
        Identity.load(path)
