"""A seed SIGKILLed in the middle of a joiner's walk of its table: the joiner, told only that
seed's address, still joins, learns every member from the ones the hello's answer named, and
every member learns it. The seed is a real process; it kills itself at the fault point
`join.seed.paging` (`common/faults.py`), so the kill lands at that exact message."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from cli_zygote import cli_popen
from conftest import DEATH_SEEN_WITHIN_S, TEST_LIVENESS, statuses, wait_until

from starling.common.faults import ENV
from starling.node.node import NodeConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MEMBERS = 12
# The seed answers a hello with what twice its bytes hold (a record or two) and pages the rest
# (`table_page_bytes`): a table of a dozen here stands for one of thousands, past what a hello's
# answer may carry at ten times its bytes.
SEED = """
import sys, time
from starling.node import Node, NodeConfig
from starling.node.admission import AdmissionConfig
from starling.node.swim import Liveness
members = int(sys.argv[2])
node = Node(config=NodeConfig(liveness=Liveness(probe_interval_s=0.2, suspicion_base_s=3.0),
                              admission=AdmissionConfig(stranger_reply_factor=2, table_page_bytes=1536)))
node.start("tcp://127.0.0.1:0", [sys.argv[1]])
while len(node.live_peers()) < members:
    time.sleep(0.05)
print("seed:", node.address, flush=True)
while True:
    time.sleep(1)
"""


def test_a_seed_killed_while_a_joiner_walks_its_table_leaves_the_joiner_a_member_of_everyone(make_node, procs):
    members = [make_node("tcp")]
    members += [make_node("tcp", join=[members[0].address]) for _ in range(MEMBERS - 1)]
    seed = cli_popen([sys.executable, "-c", SEED, members[0].address, str(MEMBERS)],
                     env={**os.environ, ENV: "join.seed.paging:kill"},
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.append(seed)
    line = seed.stdout.readline()
    assert line.startswith("seed:"), f"the seed did not start: {line!r}"
    seed_addr = line.split(":", 1)[1].strip()
    assert all(wait_until(lambda m=m: len(m.live_peers()) == MEMBERS, timeout_s=60) for m in members)
    seed_id = next(p for p in statuses(members[0]) if p not in {m.peer_id for m in members})

    joiner = make_node("tcp", join=[seed_addr], config=NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0))
    # the seed answered the hello, was asked for the next page and died there
    assert seed.wait(timeout=30) == -signal.SIGKILL
    everyone = {m.peer_id for m in members}
    assert wait_until(lambda: everyone <= set(joiner.live_peers()), timeout_s=60), statuses(joiner)
    for m in members:
        assert wait_until(lambda m=m: statuses(m).get(joiner.peer_id) == "alive", timeout_s=60), statuses(m)
    for node in (joiner, *members):  # and the seed is dead to all, the joiner included
        assert wait_until(lambda node=node: statuses(node).get(seed_id) == "dead", timeout_s=DEATH_SEEN_WITHIN_S), \
            statuses(node)
