"""The simulator end to end: real nodes in one process, a tiny protocol, churn, output files."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from starling.protocols.base import Protocol, ProtocolConfig, StepReport, register, registered_protocols
from starling.runtime import LinkModel, SimConfig, SimError, Simulation, parse_churn


@dataclass(frozen=True)
class EchoConfig(ProtocolConfig):
    lr: float = 0.1
    sync_every: int = 2  # 0: never send anything
    wait_sends: bool = True  # block the step until every send has left (so slow links show in wall time)
    step_sleep_s: float = 0.0  # pace the steps, so that churn lands mid-run


class EchoAverage(Protocol):
    """Test-only local SGD: every `sync_every` steps it sends its parameters to every peer
    (fire and forget) and averages in the latest it got from each. Never waits on a peer."""

    name = "test-echo"
    config_class = EchoConfig

    def __init__(self, node, model, config) -> None:
        super().__init__(node, model, config)
        self._latest: dict[str, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        node.on("test-echo.params", self._on_params)

    def _on_params(self, msg) -> None:
        with self._lock:
            self._latest[msg.sender] = [t.clone() for t in msg.payload]

    def step(self, loss_fn) -> StepReport:
        time.sleep(self.config.step_sleep_s)
        before = self.node.stats.total_sent()
        loss = loss_fn()
        self.model.zero_grad()
        loss.backward()
        params = list(self.model.parameters())
        with torch.no_grad():
            for p in params:
                p -= self.config.lr * p.grad
        self.step_count += 1
        synced = bool(self.config.sync_every) and self.step_count % self.config.sync_every == 0
        if synced:
            tensors = [p.detach().clone() for p in params]
            sends = [self.node.send(peer, "test-echo.params", {"step": self.step_count}, tensors)
                     for peer in self.node.live_peers()]
            for send in sends if self.config.wait_sends else ():
                try:
                    send.result(timeout=10)
                except Exception:  # a peer that just died: this round goes on without it
                    pass
            with self._lock, torch.no_grad():
                others = list(self._latest.values())
                for i, p in enumerate(params):
                    p.copy_(torch.stack([p.detach()] + [o[i] for o in others]).mean(0))
        return StepReport(step=self.step_count, loss=loss.item(), synced=synced,
                          bytes_sent=self.node.stats.total_sent() - before)


if "test-echo" not in registered_protocols():
    register(EchoAverage)

TINY = dict(protocol="test-echo", task="quadratic", task_options={"dim": 64}, transport="inproc")


def summary_fields(summary: dict[str, Any]) -> None:
    for key in ("protocol", "peers", "steps", "task", "train_loss", "eval_loss", "bytes_sent_per_peer", "wall_s"):
        assert key in summary, key


def test_three_peers_train_and_report_the_summary():
    result = Simulation(SimConfig(peers=3, steps=6, **TINY)).run()
    s = result.summary
    summary_fields(s)
    assert (s["protocol"], s["peers"], s["steps"], s["task"]) == ("test-echo", 3, 6, "quadratic")
    assert s["final_peers"] == 3 and all(p.status == "finished" for p in result.peers)
    assert all(len(p.records) == 6 for p in result.peers)
    first = sum(p.records[0]["loss"] for p in result.peers) / 3
    assert s["train_loss"] < first  # it trained
    assert s["bytes_sent_per_peer"] > 3 * 2 * 64 * 4  # 3 syncs x 2 peers x 64 floats
    assert s["bytes_sent_per_peer_total"] > s["bytes_sent_per_peer"]  # membership counted apart
    assert s["eval_loss"] is not None and s["wall_s"] > 0


def test_a_simulation_repeats_bit_for_bit_and_another_seed_does_not():
    """Simulated peers have seeded keys (rank r of seed s is the same peer id in every run),
    and owners sum parts in member order, so a run without churn repeats exactly."""
    config = SimConfig(peers=3, steps=8, protocol="streaming-diloco", task="charlm", transport="inproc",
                       task_options={"n_embd": 16, "batch_size": 2, "eval_batches": 1, "corpus_chars": 20_000},
                       options={"sync_every": 4, "fragments": 2, "overlap_steps": 1, "compressor": "int4"})
    first, again = Simulation(config).run(), Simulation(config).run()
    assert [p.peer_id for p in first.peers] == [p.peer_id for p in again.peers]
    assert first.summary["eval_loss"] == again.summary["eval_loss"]
    assert [p.records[-1]["loss"] for p in first.peers] == [p.records[-1]["loss"] for p in again.peers]
    other = Simulation(dataclasses.replace(config, seed=1)).run()
    assert not {p.peer_id for p in other.peers} & {p.peer_id for p in first.peers}


def test_a_protocol_that_sends_nothing_reports_zero_protocol_bytes():
    result = Simulation(SimConfig(peers=2, steps=3, options={"sync_every": "0"}, **TINY)).run()
    assert result.summary["bytes_sent_per_peer"] == 0


def test_a_slow_link_shows_in_wall_time_and_a_lossy_one_drops_messages():
    # 2000 floats = 8 kB per message; at 1 Mbit/s that is 64 ms on the wire, 4 syncs in a row.
    slow = LinkModel(bandwidth_bps=1e6, latency_s=0.02)
    config = SimConfig(peers=2, steps=4, options={"sync_every": "1"}, link=slow,
                       **{**TINY, "task_options": {"dim": 2000}})
    summary = Simulation(config).run().summary
    assert summary["wall_s"] >= 4 * 0.084 * 0.9
    assert summary["link_delay_s_per_peer"] >= 4 * 0.084 * 0.9
    assert summary["link"] == {"bandwidth_bps": 1e6, "latency_s": 0.02, "loss": 0.0}

    lossy = SimConfig(peers=3, steps=20, options={"sync_every": "1"}, link=LinkModel(loss=0.5, seed=1), **TINY)
    summary = Simulation(lossy).run().summary
    assert 0 < summary["messages_dropped"] < 3 * 2 * 20


def test_out_dir_holds_per_peer_json_lines_and_a_summary(tmp_path):
    result = Simulation(SimConfig(peers=2, steps=4, **TINY)).run()
    result.write(tmp_path / "run")
    for rank in (0, 1):
        lines = (tmp_path / "run" / f"peer-{rank}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        for r in records:
            assert {"step", "loss", "wall_s", "bytes_sent", "bytes_by_topic", "sockets_opened_by_topic"} <= r.keys()
        assert records[-1]["bytes_by_topic"].get("test-echo.params", 0) > 0
        assert records[-1]["bytes_sent"] >= records[0]["bytes_sent"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary_fields(summary)
    peers = json.loads((tmp_path / "run" / "peers.json").read_text())
    assert [p["status"] for p in peers] == ["finished", "finished"]


@pytest.mark.slow
def test_churn_kills_a_peer_and_a_newcomer_joins_with_the_swarm_state():
    config = SimConfig(peers=3, steps=30, churn=parse_churn("join@3,kill:1@6,leave:2@8"),
                       options={"step_sleep_s": "0.1"}, **TINY)
    result = Simulation(config).run()
    by_rank = {p.rank: p for p in result.peers}
    assert [by_rank[r].status for r in range(4)] == ["finished", "killed", "left", "finished"]
    assert len(by_rank[1].records) == 6 and len(by_rank[2].records) == 8
    joiner = by_rank[3]
    # it took a trained state (the serving peer may still be a step behind the trigger)
    assert joiner.joined_at_step >= 1
    assert [r["step"] for r in joiner.records] == list(range(joiner.joined_at_step + 1, 31))
    assert joiner.eval_loss is not None
    assert result.summary["final_peers"] == 2
    assert result.summary["peer_status"] == {"0": "finished", "1": "killed", "2": "left", "3": "finished"}


class Boom(EchoAverage):
    name = "test-boom"

    def step(self, loss_fn) -> StepReport:
        if self.step_count == 1 and self.node.peer_id == min([*self.node.live_peers(), self.node.peer_id]):
            raise RuntimeError("boom")
        return super().step(loss_fn)


if "test-boom" not in registered_protocols():
    register(Boom)


def test_a_failing_peer_fails_the_simulation_with_its_error():
    with pytest.raises(SimError, match="boom"):
        Simulation(SimConfig(peers=2, steps=3, **{**TINY, "protocol": "test-boom"})).run()


def test_bad_configs_fail_before_any_node_starts():
    with pytest.raises(ValueError, match="peers"):
        SimConfig(peers=0)
    with pytest.raises(ValueError, match="processes"):
        SimConfig(processes=True, transport="inproc")
    with pytest.raises(ValueError, match="transport"):
        SimConfig(transport="udp")
    from starling.protocols.base import ProtocolError

    with pytest.raises(ProtocolError, match="unknown protocol"):
        Simulation(SimConfig(protocol="no-such-protocol", **{k: v for k, v in TINY.items() if k != "protocol"})).run()
    with pytest.raises(ProtocolError, match="sync_every"):
        Simulation(SimConfig(peers=2, steps=2, options={"sync_every": "often"}, **TINY)).run()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_processes_true_still_runs_one_os_process_per_peer(tmp_path):
    # Spawned children import this module by name to find the test protocol.
    # ready_timeout_s: each child imports torch, which took 60-100 s on a starved CI machine.
    config = SimConfig(peers=2, steps=4, processes=True, ready_timeout_s=400,
                       **{**TINY, "protocol": f"{__name__}:test-echo", "transport": "tcp"})
    result = Simulation(config).run()
    assert [p.status for p in result.peers] == ["finished", "finished"]
    assert len({p.peer_id for p in result.peers}) == 2
    assert result.summary["bytes_sent_per_peer"] > 0 and result.summary["processes"] == 2  # True: one per peer
