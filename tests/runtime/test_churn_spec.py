"""The churn spec grammar: kill:RANK@STEP, leave:RANK@STEP, join[:COUNT]@STEP."""
from __future__ import annotations

import pytest

from starling.runtime import ChurnEvent, ChurnSpecError, SimConfig, check_churn, parse_churn


def test_events_parse_in_order():
    assert parse_churn("kill:1@50, join@80,leave:2@60,join:3@90") == (
        ChurnEvent("kill", 50, rank=1), ChurnEvent("join", 80), ChurnEvent("leave", 60, rank=2),
        ChurnEvent("join", 90, count=3),
    )
    assert parse_churn("") == ()
    assert ",".join(map(str, parse_churn("kill:1@50,join:2@80"))) == "kill:1@50,join:2@80"


@pytest.mark.parametrize("spec", ["kill@50", "kill:x@5", "join:@5", "crash:1@5", "kill:1", "join@", "join:0@5"])
def test_bad_events_name_the_event(spec):
    with pytest.raises(ChurnSpecError) as info:
        parse_churn(spec)
    assert spec.split(",")[0] in str(info.value)


@pytest.mark.parametrize("spec, peers, steps, needle", [
    ("kill:4@5", 4, 100, "ranks run 0..3"),
    ("kill:1@100", 4, 100, "has 100 steps"),
    ("kill:1@5,leave:1@6", 4, 100, "twice"),
    ("kill:0@5,kill:1@6", 2, 100, "every peer"),
])
def test_events_must_fit_the_run(spec, peers, steps, needle):
    with pytest.raises(ChurnSpecError, match=needle):
        check_churn(parse_churn(spec), peers, steps)
    with pytest.raises(ValueError, match=needle):
        SimConfig(peers=peers, steps=steps, churn=parse_churn(spec))


def test_joiners_get_the_next_ranks_and_grow_the_world():
    config = SimConfig(peers=2, steps=10, churn=parse_churn("join:2@3,kill:3@6"))
    assert config.world == 4
    assert config.stop_at(3) == ("kill", 6) and config.stop_at(0) is None
