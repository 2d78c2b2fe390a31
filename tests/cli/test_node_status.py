"""`starling node status` survives any answer: every output is JSON or one clear error line,
never a traceback (a config nested 990 deep must not kill `--json` with a RecursionError)."""
from __future__ import annotations

import json
import threading

import msgpack
import pytest
import zmq
from conftest import hold_against, wait_until
from typer.testing import CliRunner

from starling.cli.main import app
from starling.cli.shared import MAX_JSON_DEPTH, json_text
from starling.node.identity import Identity
from starling.node.node import Node
from starling.node.wire import ENVELOPE_VERSION, decode

runner = CliRunner()


def _nested(depth: int) -> object:
    value: object = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_json_text_prints_any_value():
    odd = {"config": _nested(990), 3: float("nan"), "raw": b"\x00", "set": {1}, "inf": [float("inf")]}
    printed = json.loads(json_text(odd))
    assert printed["3"] == "nan" and printed["inf"] == ["inf"] and printed["raw"] == str(b"\x00")
    depth, value = 0, printed["config"]
    while isinstance(value, (dict, list)):
        value = value["k"] if isinstance(value, dict) else value[0]
        depth += 1
    assert value == "<too deep>" and depth == MAX_JSON_DEPTH - 1


class _FakeNode:
    """A ROUTER that answers one request with a reply header of its choosing."""

    def __init__(self, body: object) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.body = body
        self.thread = threading.Thread(target=self._answer, daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        if not self.sock.poll(10_000):
            return
        route, *frames = self.sock.recv_multipart()
        rid = decode(frames).body[1]
        header = {"v": ENVELOPE_VERSION, "t": "$rep", "s": "fake", "n": 0, "ts": 0.0, "b": [rid, True, self.body],
                  "f": []}
        self.sock.send_multipart([route, msgpack.packb(header, use_bin_type=True)])

    def close(self) -> None:
        self.thread.join(15)
        self.sock.close()


def _one_error_line(result) -> str:
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("starling: error:"), result.output
    return lines[0]


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_a_body_nested_990_deep_is_one_error_line(as_json):
    fake = _FakeNode({"id": "x", "config": _nested(990)})
    try:
        result = runner.invoke(app, ["node", "status", fake.address, *(["--json"] if as_json else [])])
    finally:
        fake.close()
    assert "malformed answer" in _one_error_line(result)


def test_a_body_not_shaped_like_a_status_prints_as_json_or_one_error_line():
    for as_json in (True, False):
        fake = _FakeNode([1, {"peers": None}])
        try:
            result = runner.invoke(app, ["node", "status", fake.address, *(["--json"] if as_json else [])])
        finally:
            fake.close()
        if as_json:
            assert result.exit_code == 0 and json.loads(result.output) == [1, {"peers": None}]
        else:
            assert "malformed status" in _one_error_line(result)


def test_a_node_whose_own_config_is_too_deep_to_send_answers_with_an_error():
    node = Node().start("tcp://127.0.0.1:0", swarm_config={"deep": _nested(990)})
    try:
        line = _one_error_line(runner.invoke(app, ["node", "status", node.address, "--json"]))
        assert "handler_error" in line and "cannot be sent" in line
    finally:
        node.close()


def test_status_shows_a_replicas_rank_digests_and_whether_they_agree():
    node = Node().start("tcp://127.0.0.1:0", security="plaintext")
    try:
        node.set_status_info(replica={"ranks": 2, "step": 50, "agree": False, "digests": ["aaaa", "bbbb"]})
        as_json = runner.invoke(app, ["node", "status", node.address, "--json"])
        table = runner.invoke(app, ["node", "status", node.address])
    finally:
        node.close()
    assert json.loads(as_json.output)["info"]["replica"]["digests"] == ["aaaa", "bbbb"]
    assert "replica of 2 ranks, at step 50 their models DIFFER: aaaa bbbb" in table.output
    assert "trust" not in table.output  # a node that holds nothing against anyone says nothing of it


def test_status_shows_the_bans_counts_and_accusations_a_node_holds_against_its_peers(make_node):
    node = make_node("tcp")
    banned = make_node("tcp", join=[node.address])
    assert wait_until(lambda: banned.peer_id in node.live_peers())
    accused = Identity.generate()
    hold_against(node, banned.identity, accused)
    assert wait_until(lambda: node.stats.snapshot()["rejected"].get("banned", 0) > 0)  # its heartbeats, dropped
    as_json = json.loads(runner.invoke(app, ["node", "status", node.address, "--json"]).output)
    table = runner.invoke(app, ["node", "status", node.address])
    me, b, a = node.peer_id, banned.peer_id, accused.peer_id
    assert as_json["trust"] == {
        "counts": {b: {"screened": 3, "clipped": 1, "accused.forged_part": 1}, a: {"refused": 2, "accused.late_part": 1}},
        "banned": {b: {"kind": "forged_part", "round": 7, "witnesses": [me], "verifiable": True}},
        "accused": {a: [me]},
    }
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert any(line.startswith("  trust (") and "messages from banned peers dropped)" in line for line in lines)
    for line in (f"    banned   {b}  forged_part evidence of round 7 (verifiable), by {me}",
                 f"    counts   {b}  accused.forged_part 1  clipped 1  screened 3",
                 f"    counts   {a}  accused.late_part 1  refused 2",
                 f"    accused  {a}  by {me}"):
        assert line in lines, table.output
