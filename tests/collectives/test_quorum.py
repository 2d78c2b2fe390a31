"""The quorum close: a bad ask is refused and counted, and a leader's answer that is no closing
set is read as none."""
from __future__ import annotations

import pytest
from conftest import swarm

from starling.collectives import ReduceTimeouts
from starling.collectives.bodies import Closing
from starling.collectives.quorum import QuorumClose
from starling.node import Refusal, refusal_of


def test_a_bad_ask_is_refused_and_a_malformed_closing_set_is_read_as_none(make_node):
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    leader_node, asker_node = (a, b) if members[0] == a.peer_id else (b, a)
    quorum = QuorumClose(leader_node, "test.q", 1, 0.0, ReduceTimeouts(round_timeout_s=5.0))
    for body in ({"round": 0, "members": list(members), "weight": float("nan")},
                 {"round": 0, "members": list(members), "weight": -2},
                 {"round": -1, "members": list(members), "weight": 1.0},
                 {"members": list(members)}):
        reply = asker_node.request(leader_node.peer_id, "test.q", body).body
        assert refusal_of(reply) is Refusal.MALFORMED
    assert leader_node.stats.rejected["test.q.malformed"] == 4
    assert not quorum._open and not quorum._closed

    # a leader whose answer is not a closing set: the asker counts it and is in no set
    for bad in ({"ok": True, "round": 0, "closed": [["x", -1.0]]}, {"ok": True, "round": 3, "closed": [["x", 1]]},
                {"ok": True, "round": 0, "closed": [["y", 1], ["x", 1]]}, {"ok": True, "round": 0}, ["nope"]):
        leader_node.on("test.fake", lambda msg, bad=bad: bad)
        asker = QuorumClose(asker_node, "test.fake", 1, 0.0, ReduceTimeouts(round_timeout_s=5.0))
        assert asker.ask(0, members, 1.0).result(timeout=30) is None
        with pytest.raises(ValueError):
            Closing.from_wire(bad, 0)
    assert asker_node.stats.rejected["test.fake.malformed_close"] == 5
    with pytest.raises(ValueError, match="weight"):
        quorum.ask(0, members, float("nan"))
