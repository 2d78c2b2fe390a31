"""Smoke test of benchmarks/control_plane.py: its quick run prints every row with its figure.
Rates, shares and RSS are not checked here (the machine is shared); the rows whose figure is
a count of what the hardening rules out are: no malformed address stops a node, no forged
beat is taken, no dial-back goes to a third party."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_zygote import cli_run

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "control_plane.py"
ROWS = ["malformed_addresses", "dial_back", "forged_beats", "relay_replays_after_sessions", "relay_replays_after_forgetting",
        "amplification",
        "member_pull_rate", "member_status_rate", "join_table", "join_table_max_records", "sybil_lockout",
        "relay_delivery_under_flood",
        "relay_memory_never_reader", "relay_delivery_under_capture", "relay_delivery_under_steering"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # two processes that import torch beside this one, on a starved box
def test_quick_run_prints_every_row_with_its_figure():
    out = cli_run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=500,
                         check=True).stdout
    rows = {r["row"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    assert rows.pop("run")["quick"] is True
    assert list(rows) == ROWS
    for name, r in rows.items():
        assert r.get("not_measurable") is None, f"{name}: {r.get('not_measurable')}"
        assert r["figure"] is not None and isinstance(r["met"], bool), name
        assert {"unit", "target"} <= set(r), name
    malformed = rows["malformed_addresses"]
    assert malformed["figure"] == 0, malformed["stopped_by"]
    assert set(malformed["outcomes_by_channel"]) == {"stranger_hello", "stranger_reach", "member_announce",
                                                     "member_hello_reannounce"}
    forged = rows["forged_beats"]
    assert forged["control_genuine_relayed_beat_accepted"] is True  # the channel carries beats at all
    assert forged["figure"] == 0 and forged["attempts"] == 10, forged["accepted"]
    dial = rows["dial_back"]
    assert dial["figure"] == 0 and dial["control_dial_to_requester_ip_connections"] >= 1
    assert rows["amplification"]["requests"]["echo"]["reply_bytes"] > 0
    assert rows["relay_delivery_under_flood"]["flood"]["relay_sent"] > 0
    lockout = rows["sybil_lockout"]  # the table was full of the attacker's keys, and the joiner got in
    assert lockout["joined"] is True and lockout["table_before_joiner"] == lockout["table_cap"], lockout
    assert lockout["table_after"] <= lockout["table_cap"]
    # the capturing member was handed messages to drop; the steering one sent its claims
    assert rows["relay_delivery_under_capture"]["attacker"]["dropped"] > 0
    assert rows["relay_delivery_under_steering"]["attacker"]["claims_sent"] > 0
