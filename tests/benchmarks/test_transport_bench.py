"""benchmarks/transport.py's small-request row runs end to end: every reply answers its own
request (the timing itself is not checked: the machine is shared)."""
from __future__ import annotations

from conftest import load_benchmark


def test_small_requests_time_replies_that_each_answer_their_request():
    row = load_benchmark("transport").small_requests(600, 1, in_flight=256)
    assert row["bench"] == "small_requests" and row["requests"] == 600 and row["us_per_request"] > 0


def test_idle_waits_measure_both_ways_and_every_wait_returns_its_own_result():
    row = load_benchmark("transport").idle_waits(200, 0.2)
    assert row["bench"] == "idle_waits" and row["waits"] == 200
    assert row["core_share"] >= 0 and row["core_share_before"] > 0 and row["ratio"] is not None


def test_socket_churn_opens_a_socket_per_send_and_watches_only_the_pinned_past_the_cap():
    row = load_benchmark("transport").socket_churn(40, peers=12, cap=4)
    assert row["bench"] == "socket_churn" and row["sends"] == 40
    assert row["us_per_send"] > 0 and row["cpu_us_per_send_before"] > 0
    assert row["monitors_open"] == 2 and row["monitors_open_before"] == 4  # the 2 pinned; every open one
