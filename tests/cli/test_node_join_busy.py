"""`starling node start --join` against a first node whose transfer slots other members hold:
the joiner retries with backoff, says so, stops when told to, and gives up only at
its deadline."""
from __future__ import annotations

import signal
import subprocess

import pytest
from cli_zygote import cli_popen
from test_node_training import FAST, Lines, starling

from starling.node import Node, NodeConfig, RefusedError
from starling.node.swim import Liveness
from starling.node.transfer import OPEN_TOPIC, TransferConfig
from starling.runtime import Trainer, TrainSpec
from starling.runtime.trainer import STATE_BLOB

LIVENESS = Liveness(probe_interval_s=0.2, suspicion_base_s=6.0)  # FAST's


@pytest.mark.slow
@pytest.mark.timeout(600)  # two Python processes that import torch, on a loaded 2-core box
def test_a_joiner_waits_out_members_that_hold_every_transfer_slot_and_gives_up_only_at_its_deadline():
    """Members that held every transfer slot of the first node made `node start --join` exit 2
    within 2.6 s. The first node here is in this process, so that its slots never idle out
    (idle_timeout_s) while the joiners start."""
    spec = TrainSpec("allreduce", "quadratic", {"lr": 0.05, "round_timeout_s": 5})
    config = NodeConfig(liveness=LIVENESS, transfer=TransferConfig(idle_timeout_s=600.0))
    first = Node(config=config).start("tcp://127.0.0.1:0", security="plaintext",
                                      swarm_config=spec.to_swarm_config())
    trainer = Trainer(first, spec, 0, 16)
    procs, squatters = [], []
    try:
        trainer.create_protocol()  # serves the state from now on
        for _ in range(4):  # 2 transfers each (the most one peer may hold): all 8 of the first's slots
            squatter = Node(config=NodeConfig(liveness=LIVENESS)).start(
                "tcp://127.0.0.1:0", [first.address], security="plaintext")
            squatters.append(squatter)
            for _ in range(2):
                squatter.request(first.peer_id, OPEN_TOPIC, {"name": STATE_BLOB})
        with pytest.raises(RefusedError):
            squatters[0].request(first.peer_id, OPEN_TOPIC, {"name": STATE_BLOB})

        hasty = cli_popen(
            starling("node", "start", *FAST, "--join", first.address, "--state-fetch-timeout-s", "2"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(hasty)
        gave_up = Lines(hasty).text("starling: error:")
        assert "no peer could supply" in gave_up and "attempts on 5 peers" in gave_up, gave_up
        assert "1 busy, 4 without it" in gave_up, gave_up  # the squatters serve no state
        assert hasty.wait(60) == 2

        stopped = cli_popen(starling("node", "start", *FAST, "--join", first.address),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(stopped)
        Lines(stopped).text("trying again in")
        stopped.send_signal(signal.SIGTERM)  # heard while it waits, not 120 s later
        assert stopped.wait(60) == 0

        patient = cli_popen(starling("node", "start", *FAST, "--join", first.address),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(patient)
        theirs = Lines(patient)
        assert "1 busy" in theirs.text("trying again in")
        for squatter in squatters:  # a leaver's slots are freed at once
            squatter.leave()
        started = theirs.until(lambda r: r.get("event") == "training")
        assert started["protocol"] == "allreduce"
        patient.send_signal(signal.SIGTERM)
        assert patient.wait(60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for squatter in squatters:
            squatter.close()
        trainer.close()
        first.close()
