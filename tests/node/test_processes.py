"""Real `starling node start` processes on loopback: join, SIGKILL, SIGTERM, status."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from cli_zygote import cli_popen, cli_run
from conftest import DEATH_SEEN_WITHIN_S, statuses, wait_until

# Each test starts Python processes that import torch: 1-3 s on a quiet box, over 60 s seen
# on a starved 2-core CI machine. The timeouts below are for the latter.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAST = ["--probe-interval-s", "0.2", "--suspicion-s", "3"]


def starling(*args: str) -> list[str]:
    return [sys.executable, "-m", "starling.cli.main", *args]


def spawn_node(*args: str) -> tuple[subprocess.Popen, str]:
    proc = cli_popen(starling("node", "start", *FAST, *args), stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()  # the one line with the join address, printed once joined
    if "join with:" not in line:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        raise AssertionError(f"node did not start: {line!r}")
    return proc, line.rsplit("join with:", 1)[1].strip()


def test_processes_join_crash_and_leave(make_node, procs):
    a, a_addr = spawn_node()
    procs.append(a)
    b, b_addr = spawn_node("--join", a_addr)
    procs.append(b)
    me = make_node("tcp", join=[b_addr])  # joins through B, must learn A too
    assert wait_until(lambda: len(me.live_peers()) == 2, timeout_s=20), statuses(me)
    ids = {p.id: p for p in me.peers}
    b_id = next(i for i, p in ids.items() if b_addr.split("#")[0] in p.addresses)
    a_id = next(i for i in ids if i != b_id)

    b.send_signal(signal.SIGKILL)
    assert wait_until(lambda: statuses(me)[b_id] == "dead", timeout_s=DEATH_SEEN_WITHIN_S)

    a.send_signal(signal.SIGTERM)  # graceful: announced leave, seen at once
    assert wait_until(lambda: statuses(me)[a_id] == "left", timeout_s=5)
    assert a.wait(60) == 0  # a clean exit; an idle node took 2-11 s to exit after SIGTERM on a starved box


def test_status_command_prints_the_peer_table(procs):
    a, a_addr = spawn_node()
    procs.append(a)
    b, _ = spawn_node("--join", a_addr)
    procs.append(b)

    def two_alive() -> bool:
        out = cli_run(starling("node", "status", a_addr, "--json"), capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            return False
        status = json.loads(out.stdout)
        return len(status["peers"]) == 1 and {"id", "status", "addresses"} <= set(status["peers"][0])

    assert wait_until(two_alive, timeout_s=400, interval_s=0.5)  # each call starts a Python process


def test_allowlisted_process_admits_only_listed_keys(tmp_path, procs, make_node):
    from starling.node.address import encode_key
    from starling.node.identity import Identity
    from starling.node.node import JoinError, Node, NodeConfig

    member, outsider = Identity.generate(), Identity.generate()
    allow = tmp_path / "allow"
    allow.write_text(encode_key(member.curve_public) + "\n")
    a, a_addr = spawn_node("--authorized-keys", str(allow))
    procs.append(a)
    ok = make_node("tcp", key=member, join=[a_addr])
    assert wait_until(lambda: len(ok.live_peers()) == 1)
    with pytest.raises(JoinError):
        Node(outsider, NodeConfig(join_timeout_s=1.0, join_deadline_s=1.0)).start("tcp://127.0.0.1:0", [a_addr])
