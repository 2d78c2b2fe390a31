"""A table pull's list of held peers (`node.have`): built from the codes a table keeps in id
order, read off the wire, and matched as arrays, with the answers the prefixes themselves give."""
from __future__ import annotations

import random

import numpy as np
import pytest

from starling.node.have import HAVE_CHARS, NO_CODE, Have, HaveError, encode_codes, prefix_code
from starling.node.identity import Identity
from starling.node.swim import IdSet
from starling.node.table_sync import MAX_HAVE, parse_sync
from starling.node.wire import WireError


@pytest.fixture(scope="module")
def ids() -> list[str]:
    return [Identity.generate().peer_id for _ in range(300)]


def test_a_list_names_exactly_the_ids_whose_prefixes_it_carries(ids):
    held, others = ids[:200], ids[200:]
    have = Have.of(held)
    prefixes = {p[:HAVE_CHARS] for p in held}
    assert len(have) == len(held)
    assert have.names(ids) == [p[:HAVE_CHARS] in prefixes for p in ids]
    table = IdSet(ordered=True, code=prefix_code)
    for p in ids:
        table.add(p)
    lacking = have.lacking(table.codes_in_order())
    assert [table.in_order()[i] for i in lacking] == sorted(p for p in others if p[:HAVE_CHARS] not in prefixes)
    assert list(lacking) == sorted(lacking)  # in the table's id order, as a page walks it


def test_the_wire_form_is_the_prefixes_themselves(ids):
    codes = np.array([prefix_code(p) for p in ids[:5]], dtype=np.int64)
    assert encode_codes(codes) == "".join(p[:HAVE_CHARS] for p in ids[:5]).encode("ascii")


def test_an_id_no_prefix_can_name_is_never_named_and_never_sent():
    assert prefix_code("abc") == NO_CODE and prefix_code("abcdé") == NO_CODE and prefix_code("abcdeé") == NO_CODE
    assert encode_codes(np.array([NO_CODE, prefix_code("abcdef")], dtype=np.int64)) == b"abcdef"
    have = Have.parse(b"abcdefabc\x00\x00\x00", 4)
    assert have.names(["abcdefzz", "abc", "abcdeg", "abc\x00\x00\x00x"]) == [True, False, False, True]
    assert Have.parse(b"", 4).names(["abcdef"]) == [False] and not Have.parse(b"", 4)


@pytest.mark.parametrize("raw", [b"abcde", b"abcdef" * 5, b"abcde\xff"])
def test_a_list_that_is_not_whole_ascii_prefixes_within_its_bound_is_refused(raw):
    with pytest.raises(HaveError):
        Have.parse(raw, 4)


def test_a_sync_ask_reads_its_list_or_refuses_it_and_an_empty_one_names_nothing():
    assert parse_sync({"have": b""})[1] is None and parse_sync(None)[1] is None
    after, have, _, _ = parse_sync({"after": "x", "have": b"abcdefghijkl"})
    assert after == "x" and have.names(["abcdefxx", "ghijklxx", "zzzzzzxx"]) == [True, True, False]
    for bad in (b"abcde", b"abcde\xff", b"a" * HAVE_CHARS * (MAX_HAVE + 1), "abcdef"):
        with pytest.raises(WireError, match="sync have"):
            parse_sync({"have": bad})


def test_the_codes_follow_the_sorted_ids_through_any_adds_and_removes(ids):
    rng = random.Random(7)
    live = IdSet(ordered=True, code=prefix_code)
    held: set[str] = set()
    for _ in range(3000):
        p = rng.choice(ids)
        if p in held and rng.random() < 0.5:
            assert live.remove(p)
            held.discard(p)
        elif p not in held:
            assert live.add(p)
            held.add(p)
    assert live.in_order() == sorted(held)
    assert live.codes_in_order().tolist() == [prefix_code(p) for p in sorted(held)]
    with pytest.raises(ValueError, match="ordered"):
        IdSet(code=prefix_code)
    with pytest.raises(ValueError, match="no codes"):
        IdSet(ordered=True).codes_in_order()
