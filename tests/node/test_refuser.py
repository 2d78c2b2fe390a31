"""A Refuser counts bad input by topic and reason, logs it, and answers with a refusal body."""
from __future__ import annotations

import logging
from collections import Counter

from starling.node.rpc import Refusal, Refuser, refusal_of
from starling.node.stats import NodeStats


def test_a_refusal_is_counted_logged_and_answered(caplog) -> None:
    stats, counters = NodeStats(), Counter()
    refuse = Refuser(stats, "test.topic", "me", counters)
    with caplog.at_level(logging.INFO, logger="starling.node.rpc"):
        body = refuse(Refusal.LATE, "the round already closed", step=4)
    assert refusal_of(body) is Refusal.LATE and body["step"] == 4
    assert body["reason"] == "late: the round already closed"
    assert stats.rejected == {"test.topic.late": 1} and counters == {"rejected.late": 1}
    assert "test.topic rejected (late)" in caplog.text


def test_bad_input_without_an_answer_is_counted_under_its_own_name() -> None:
    stats = NodeStats()
    Refuser(stats, "test.q", "me").count("malformed_close", "round 3")
    assert stats.rejected == {"test.q.malformed_close": 1}
