from __future__ import annotations

import os

import pytest

from starling.node.address import (
    AddressError,
    PeerAddress,
    decode_key,
    encode_key,
    is_loopback,
    parse_address,
    parse_bind,
)

KEY = bytes(range(32))
KEY_TEXT = encode_key(KEY)


def test_key_encoding_round_trips():
    assert len(KEY_TEXT) == 43
    assert "#" not in KEY_TEXT and "=" not in KEY_TEXT
    assert decode_key(KEY_TEXT) == KEY
    for _ in range(50):
        raw = os.urandom(32)
        assert decode_key(encode_key(raw)) == raw


@pytest.mark.parametrize(
    "text", ["", "abc", KEY_TEXT[:-1], KEY_TEXT + "A", KEY_TEXT[:-1] + "=", "+" * 43, "/" * 43]
)
def test_decode_key_rejects(text):
    with pytest.raises(AddressError):
        decode_key(text)


def test_decode_key_rejects_non_canonical_last_char():
    # the last base64 char carries 2 padding bits that must be zero
    last = KEY_TEXT[-1]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    other = alphabet[alphabet.index(last) ^ 1]
    with pytest.raises(AddressError):
        decode_key(KEY_TEXT[:-1] + other)


def test_encode_key_rejects_wrong_length():
    with pytest.raises(AddressError):
        encode_key(b"\x00" * 31)


@pytest.mark.parametrize(
    "text, endpoint, transport",
    [
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555", "tcp"),
        ("tcp://10.1.2.3:1", "tcp://10.1.2.3:1", "tcp"),
        ("tcp://example.com:65535", "tcp://example.com:65535", "tcp"),
        ("tcp://node-1.swarm.internal:7000", "tcp://node-1.swarm.internal:7000", "tcp"),
        ("tcp://localhost:80", "tcp://localhost:80", "tcp"),
        ("tcp://[::1]:5555", "tcp://[::1]:5555", "tcp"),
        ("tcp://[fe80::1:2]:5555", "tcp://[fe80::1:2]:5555", "tcp"),
        ("ipc:///tmp/starling.sock", "ipc:///tmp/starling.sock", "ipc"),
        ("inproc://peer-a", "inproc://peer-a", "inproc"),
    ],
)
def test_parse_address_good(text, endpoint, transport):
    plain = parse_address(text)
    assert plain == PeerAddress(endpoint, None)
    assert plain.transport == transport
    assert str(plain) == endpoint
    keyed = parse_address(f"{text}#{KEY_TEXT}")
    assert keyed.endpoint == endpoint
    assert keyed.curve_key == KEY
    assert str(keyed) == f"{endpoint}#{KEY_TEXT}"
    assert parse_address(str(keyed)) == keyed


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "empty"),
        ("127.0.0.1:5555", "scheme"),
        ("udp://127.0.0.1:5555", "scheme"),
        ("epgm://eth0;239.1.1.1:5555", "scheme"),
        ("tcp://127.0.0.1", "HOST:PORT"),
        ("tcp://:5555", "host"),
        ("tcp://*:5555", "wildcard"),
        ("tcp://127.0.0.1:0", "range"),
        ("tcp://127.0.0.1:65536", "range"),
        ("tcp://127.0.0.1:99999999", "range"),
        ("tcp://127.0.0.1:*", "number"),
        ("tcp://127.0.0.1:-1", "number"),
        ("tcp://127.0.0.1:http", "number"),
        ("tcp://127.0.0.1:５５", "number"),
        ("tcp://256.1.1.1:5555", "IPv4"),
        ("tcp://1.2.3:5555", "IPv4"),
        ("tcp://::1:5555", "brackets"),
        ("tcp://[::1:5555", "unclosed"),
        ("tcp://[::1]5555", "PORT"),
        ("tcp://[nothex]:5555", "IPv6"),
        ("tcp://bad_host:5555", "hostname"),
        ("tcp://-bad.com:5555", "hostname"),
        ("tcp://a..b:5555", "hostname"),
        ("tcp://host name:5555", "whitespace"),
        ("ipc://", "empty"),
        ("inproc://", "empty"),
        ("tcp://127.0.0.1:5555#", "empty curve key"),
        ("tcp://127.0.0.1:5555#short", "43"),
        (f"tcp://127.0.0.1:5555#{KEY_TEXT}A", "43"),
        (f"tcp://127.0.0.1:5555#{KEY_TEXT}#{KEY_TEXT}", "43"),
        ("tcp://0.0.0.0:5", "every interface"),  # joining it used to wait 10 s for nothing
        ("tcp://[::]:5", "every interface"),
        ("tcp://224.0.0.1:5", "multicast"),
    ],
)
def test_parse_address_bad(text, fragment):
    with pytest.raises(AddressError, match=fragment):
        parse_address(text)


def test_address_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse_address("nope")


def test_parse_address_rejects_non_string():
    with pytest.raises(AddressError):
        parse_address(b"tcp://127.0.0.1:5555")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("tcp://*:*", "tcp://*:*"),
        ("tcp://*:0", "tcp://*:0"),
        ("tcp://*:5555", "tcp://*:5555"),
        ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"),
        ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
        ("tcp://0.0.0.0:5555", "tcp://0.0.0.0:5555"),
        ("tcp://[::]:5555", "tcp://[::]:5555"),
        ("ipc:///tmp/x.sock", "ipc:///tmp/x.sock"),
        ("inproc://x", "inproc://x"),
    ],
)
def test_parse_bind_good(text, expected):
    assert parse_bind(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        (f"tcp://*:5555#{KEY_TEXT}", "curve key"),
        ("tcp://*:65536", "range"),
        ("tcp://*", "HOST:PORT"),
        ("udp://*:5", "scheme"),
        ("tcp://*:x", "number"),
        ("", "empty"),
    ],
)
def test_parse_bind_bad(text, fragment):
    with pytest.raises(AddressError, match=fragment):
        parse_bind(text)


@pytest.mark.parametrize(
    "endpoint",
    [
        "ipc:///tmp/x.sock",
        "inproc://x",
        "tcp://127.0.0.1:5555",
        "tcp://127.255.0.9:5555",
        "tcp://[::1]:5555",
        "tcp://localhost:5555",
        "tcp://LOCALHOST:5555",
        f"tcp://127.0.0.1:5555#{KEY_TEXT}",
    ],
)
def test_is_loopback_true(endpoint):
    assert is_loopback(endpoint)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://*:5555",
        "tcp://0.0.0.0:5555",
        "tcp://[::]:5555",
        "tcp://10.0.0.1:5555",
        "tcp://192.168.1.1:5555",
        "tcp://example.com:5555",
        "tcp://localhost.example.com:5555",
        "tcp://128.0.0.1:5555",
        "garbage",
        "udp://127.0.0.1:5",
        "",
    ],
)
def test_is_loopback_false(endpoint):
    assert not is_loopback(endpoint)
