"""The collectives' wire bodies: each goes out and comes back the same, and a bad one raises
BodyError naming what is wrong."""
from __future__ import annotations

import pytest

from starling.collectives.bodies import (
    Ack,
    Ask,
    Average,
    BodyError,
    Closing,
    HeardAsk,
    HeardRow,
    Part,
    Refused,
    Skip,
    Wait,
    heard_rows,
)
from starling.collectives.compact import view_digest
from starling.node.rpc import Refusal, refusal

MEMBERS = ("a", "b", "c")


@pytest.mark.parametrize("body", [
    Part(3, 1, 0, {"codec": "none"}, members=MEMBERS),
    Part(3, 1, 2, None, view=view_digest(MEMBERS), weight=2.5),
    Part(3, 1, 2, None, view=view_digest(MEMBERS), state=b"s" * 8),
    Skip(7),
    Ask(4, MEMBERS, 0.0),
    Wait(4),
])
def test_a_body_comes_back_as_it_went(body) -> None:
    assert type(body).from_wire(body.to_wire()) == body


def test_answers_come_back_as_they_went() -> None:
    average = Average(None, ("a", "c"), (("a", 0.25), ("c", 0.75)))
    assert Average.from_wire(average.to_wire(MEMBERS), MEMBERS) == average
    flagged = Average(None, ("a", "c"), diverged=True)
    assert Average.from_wire(flagged.to_wire(MEMBERS), MEMBERS) == flagged
    scored = Average(None, ("a", "c"), scores=(2.0, ((1.5, 3.0), (-0.5, 1.0))))
    assert Average.from_wire(scored.to_wire(MEMBERS), MEMBERS) == scored
    closing = Closing(2, (("a", 1.0), ("b", 3.0)), b"s" * 64)
    assert Closing.from_wire(closing.to_wire(), 2) == closing
    ack = Ack(2, b"s" * 64)
    assert Ack.is_one(ack.to_wire()) and not Ack.is_one(closing.to_wire())
    assert Ack.from_wire(ack.to_wire(), 2) == ack


def test_a_part_keeps_the_wire_keys_the_reducer_always_sent() -> None:
    part = Part(0, 0, 0, None, view=view_digest(MEMBERS))
    assert part.to_wire() == {"step": 0, "shard": 0, "chunk": 0, "view": view_digest(MEMBERS), "packet": None}
    assert part.with_members(MEMBERS).to_wire() == {"step": 0, "shard": 0, "chunk": 0, "members": list(MEMBERS),
                                                    "packet": None}
    assert set(Average(None, MEMBERS).to_wire(MEMBERS)) == {"ok", "packet", "cm"}


def test_a_part_names_its_members_one_way() -> None:
    with pytest.raises(ValueError, match="one of the two"):
        Part(0, 0, 0, None)


@pytest.mark.parametrize(("obj", "what"), [
    (["step", 0], "map"),
    ({"step": "x", "shard": 0, "chunk": 0, "members": ["a"], "packet": None}, "step"),
    ({"step": 0, "shard": -1, "chunk": 0, "members": ["a"], "packet": None}, "shard"),
    ({"step": 0, "shard": 0, "chunk": True, "members": ["a"], "packet": None}, "chunk"),
    ({"step": 0, "shard": 0, "chunk": 0, "members": ["b", "a"], "packet": None}, "sorted"),
    ({"step": 0, "shard": 0, "chunk": 0, "members": ["a", 1], "packet": None}, "peer ids"),
    ({"step": 0, "shard": 0, "chunk": 0, "view": b"short", "packet": None}, "digest"),
    ({"step": 0, "shard": 0, "chunk": 0, "members": ["a"]}, "packet"),
    ({"step": 0, "shard": 0, "chunk": 0, "members": ["a"], "packet": [1]}, "packet"),
    ({"step": 0, "shard": 0, "chunk": 0, "members": ["a"], "packet": None, "weight": float("nan")}, "weight"),
    ({"step": 0, "shard": 0, "chunk": 0, "members": ["a"], "packet": None, "state": b"short"}, "state"),
    ({"step": 0, "shard": 0, "chunk": 0, "members": ["a"], "packet": None, "weight": -1}, "weight"),
])
def test_a_bad_part_is_named(obj, what) -> None:
    with pytest.raises(BodyError, match=what):
        Part.from_wire(obj)


@pytest.mark.parametrize("obj", [{"skip": -1}, {"skip": "1"}, {"skip": True}])
def test_a_bad_skip_is_refused(obj) -> None:
    assert Skip.is_one(obj)
    with pytest.raises(BodyError, match="skip"):
        Skip.from_wire(obj)


@pytest.mark.parametrize(("obj", "what"), [
    ({"members": ["a"]}, "round, members, weight"),
    ({"round": -1, "members": ["a"], "weight": 1.0}, "round"),
    ({"round": 0, "members": ["a", "a"], "weight": 1.0}, "unique"),
    ({"round": 0, "members": ["a"], "weight": float("inf")}, "weight"),
])
def test_a_bad_ask_is_named(obj, what) -> None:
    with pytest.raises(BodyError, match=what):
        Ask.from_wire(obj)


@pytest.mark.parametrize(("read", "obj", "what"), [
    (lambda obj: Wait.from_wire(obj), {"round": 0, "wait": 1}, "wait must be true"),
    (lambda obj: Wait.from_wire(obj), {"wait": True}, "round"),
    (lambda obj: Ack.from_wire(obj, 2), {"ok": True, "round": 3, "ack": b"s" * 64}, "round 3, not 2"),
    (lambda obj: Ack.from_wire(obj, 2), {"ok": True, "round": 2, "ack": "sig"}, "ack must be a signature"),
    (lambda obj: Ack.from_wire(obj, 2), {"ok": False, "round": 2, "ack": b"s" * 64}, "ok"),
    (lambda obj: Closing.from_wire(obj, 2), {"ok": True, "round": 2, "closed": [["a", 1.0]]}, "sig must be"),
])
def test_a_bad_ack_wait_or_closing_set_is_named(read, obj, what) -> None:
    with pytest.raises(BodyError, match=what):
        read(obj)


@pytest.mark.parametrize(("obj", "what"), [
    ({"ok": True, "packet": None, "cm": b"\x00\x00"}, "mask"),
    ({"ok": True, "packet": None, "cm": b"\x08"}, "past the last"),
    ({"ok": True, "packet": None, "cm": b"\x01", "shares": [["a", -0.5]]}, "shares"),
    ({"ok": True, "cm": b"\x01"}, "packet"),
])
def test_a_bad_average_is_named(obj, what) -> None:
    with pytest.raises(BodyError, match=what):
        Average.from_wire(obj, MEMBERS)


def test_a_refusal_reads_as_refused_with_the_owners_round() -> None:
    assert Refused.from_wire(refusal(Refusal.LATE, "the round already closed", step=9)) == \
        Refused("late: the round already closed", 9)
    assert Refused.from_wire(refusal(Refusal.BUSY)).owner_round == -1
    assert Refused.from_wire(["nope"]) == Refused("malformed reply: list")
    assert Refused.from_wire(Average(None, MEMBERS).to_wire(MEMBERS)) is None


def test_secure_aggregation_bodies_round_trip_and_refuse_what_they_are_not():
    from starling.collectives.bodies import Deal, Passed, Reveal, Revealed

    view = bytes(16)
    deal = Deal(3, view, 2, b"\1" * 146)
    assert Deal.from_wire(deal.to_wire()) == deal
    reveal = Reveal(3, view, ("a", "b"), ("c",))
    assert Reveal.from_wire(reveal.to_wire()) == reveal
    revealed = Revealed((("a", 1, 2**520, b"s" * 64),), (("c", b"p" * 32),), (b"h" * 32,))
    assert Revealed.from_wire(revealed.to_wire()) == revealed
    passed = Passed(3, view, b"\3", (("a", b"s" * 32),), (("a", "c", b"p" * 32),), (("a", (b"h" * 32,)),))
    assert Passed.from_wire(passed.to_wire()) == passed
    for bad, cls in [({"deal": 3, "view": view, "x": 0, "box": b""}, Deal),
                     ({"deal": 3, "view": view, "x": 1, "box": b"\0" * 4096}, Deal),
                     ({"deal": -1, "view": view, "x": 1, "box": b""}, Deal),
                     ({"reveal": 3, "view": b"short", "seeds": [], "pairs": []}, Reveal),
                     ({"reveal": 3, "view": view, "seeds": [1], "pairs": []}, Reveal),
                     ({"ok": True, "shares": [["a", 1, b"y", b"s"]], "pairs": [], "commits": []}, Revealed),
                     ({"ok": True, "shares": [], "pairs": [["c", b"short"]], "commits": []}, Revealed),
                     ({"ok": False, "code": "conflict"}, Revealed),
                     ({"unmasked": 3, "view": view, "alive": b"\3", "seeds": [["a"]], "pairs": [], "lists": []},
                      Passed),
                     ({"unmasked": 3, "view": view, "alive": "x", "seeds": [], "pairs": [], "lists": []}, Passed)]:
        with pytest.raises(BodyError):
            cls.from_wire(bad)


@pytest.mark.parametrize("scores", [
    [1.0, [[1.0, 2.0]]],  # one row for two contributors
    [1.0, [[1.0, float("nan")], [0.0, 1.0]]],
    [-1.0, [[1.0, 2.0], [0.0, 1.0]]],
    [1.0, [[1, 2.0], [0.0, 1.0]]],  # an int where a float goes
    "scores",
])
def test_malformed_scores_are_refused(scores) -> None:
    body = Average(None, ("a", "c")).to_wire(MEMBERS)
    body["sc"] = scores
    with pytest.raises(BodyError):
        Average.from_wire(body, MEMBERS)


def test_an_ask_for_averages_and_its_rows_round_trip_and_refuse_what_they_are_not() -> None:
    ask = HeardAsk(3, view_digest(MEMBERS), ((0, 0, "a"), (1, 2, "b")))
    assert HeardAsk.from_wire(ask.to_wire()) == ask
    row = HeardRow(1, 2, "b", Average({"codec": "none"}, ("a", "c"), sig=b"s" * 64).to_wire(MEMBERS), 1)
    assert heard_rows({"ok": True, "rows": [row.to_wire()]}) == [row]
    for bad, what in [({"heard": 3, "view": b"x", "wants": [[0, 0, "a"]]}, "view"),
                      ({"heard": 3, "view": view_digest(MEMBERS), "wants": []}, "wants"),
                      ({"heard": 3, "view": view_digest(MEMBERS), "wants": [[0, -1, "a"]]}, "want"),
                      ({"heard": 3, "view": view_digest(MEMBERS), "wants": [[0, 0, ""]]}, "owner"),
                      ({"heard": -1, "view": view_digest(MEMBERS), "wants": [[0, 0, "a"]]}, "heard")]:
        with pytest.raises(BodyError, match=what):
            HeardAsk.from_wire(bad)
    headless = HeardRow(1, 2, "b", Average(None, ("a",)).to_wire(MEMBERS), 1).to_wire()
    for bad, what in [({"ok": True, "rows": [headless]}, "header whole"),
                      ({"ok": True, "rows": [[1, 2, "b", row.average, 99]]}, "heard row"),
                      ({"ok": True, "rows": [[1, 2, "b"]]}, "heard row"),
                      ({"ok": False, "rows": []}, "say ok")]:
        with pytest.raises(BodyError, match=what):
            heard_rows(bad)
