"""runtime/metrics.py: each node exports its own registry, labels stay bounded whatever the
counters hold, training progress becomes heartbeat meta that a NaN loss cannot break, and
TensorBoard gets the progress lines' numbers."""
from __future__ import annotations

import math
import urllib.request

import pytest
from conftest import hold_against, wait_until
from prometheus_client.parser import text_string_to_metric_families

from starling.node.identity import Identity
from starling.node.stats import OTHERS, STRANGERS
from starling.node.trust import Evidence
from starling.protocols import StepReport
from starling.runtime.metrics import (
    MAX_KIND_LABELS,
    MAX_PEER_LABELS,
    MAX_REASON_LABELS,
    MAX_TOPIC_LABELS,
    MetricsServer,
    TensorBoardLog,
    TrainingProgress,
)


def _samples(url: str) -> list:
    with urllib.request.urlopen(url, timeout=30) as answer:
        text = answer.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def test_two_nodes_in_one_process_export_apart(make_node):
    a = make_node("tcp")
    b = make_node("tcp", join=[a.address])
    servers = [MetricsServer(a), MetricsServer(b)]
    try:
        ids = [{s.labels["peer_id"] for s in _samples(server.url) if s.name == "starling_node_info"}
               for server in servers]
        assert ids == [{a.peer_id}, {b.peer_id}]
        progress = TrainingProgress()
        servers[0].collector.attach(None, progress)
        progress.record(StepReport(step=4, loss=0.25, synced=True, peers=2))
        steps = [[s.value for s in _samples(server.url) if s.name == "starling_steps_total"] for server in servers]
        assert steps == [[1.0], []]  # b trains nothing: no training metrics at all
    finally:
        for server in servers:
            server.close()


def test_labels_stay_bounded_whatever_the_counters_hold(make_node):
    node = make_node("tcp")
    member = make_node("tcp", join=[node.address])
    assert wait_until(lambda: member.peer_id in node.live_peers())
    for i in range(3 * MAX_PEER_LABELS):
        node.stats.count_sent(f"not-a-member-{i}", f"topic-{i % (2 * MAX_TOPIC_LABELS)}", 10)
    node.stats.count_sent(member.peer_id, "grads", 7)
    node.stats.count_sent(STRANGERS, "$status", 5)
    for i in range(2 * MAX_REASON_LABELS):
        node.stats.count_rejected(f"reason-{i}")
    server = MetricsServer(node)
    try:
        samples = _samples(server.url)
    finally:
        server.close()
    sent = [s for s in samples if s.name == "starling_bytes_sent_total"]
    peers = {s.labels["peer"] for s in sent}
    assert peers == {member.peer_id, STRANGERS, OTHERS}  # only members get a label of their own
    assert len({s.labels["topic"] for s in sent}) <= MAX_TOPIC_LABELS + 1
    assert sum(s.value for s in sent if s.labels["peer"] == member.peer_id and s.labels["topic"] == "grads") == 7
    assert sum(s.value for s in sent if s.labels["peer"] == OTHERS) == 3 * MAX_PEER_LABELS * 10  # folded, not lost
    reasons = [s for s in samples if s.name == "starling_rejected_frames_total"]
    assert len(reasons) == MAX_REASON_LABELS + 1 and sum(s.value for s in reasons) == 2 * MAX_REASON_LABELS


def test_trust_counts_and_bans_are_exported_with_bounded_labels(make_node):
    node = make_node("tcp")
    member = make_node("tcp", join=[node.address])
    assert wait_until(lambda: member.peer_id in node.live_peers())
    stranger = Identity.generate()  # never in the table, never banned: its counts fold under <others>
    hold_against(node, member.identity, stranger)
    many = [Identity.generate() for _ in range(MAX_PEER_LABELS + 3)]

    async def ban_many_and_count_many_kinds() -> None:
        for identity in many:
            node.trust.accuse(Evidence("forged_part", identity.peer_id, identity.verify_key, 9))
        for i in range(2 * MAX_KIND_LABELS):
            node.trust.note(member.peer_id, f"x-{i}")  # sorted after the kinds above: these fold

    node.run(ban_many_and_count_many_kinds())
    server = MetricsServer(node)
    try:
        samples = _samples(server.url)
    finally:
        server.close()
    contributions = {(s.labels["peer"], s.labels["kind"]): s.value for s in samples
                     if s.name == "starling_peer_contributions_total"}
    assert contributions[member.peer_id, "screened"] == 3 and contributions[member.peer_id, "clipped"] == 1
    assert contributions[OTHERS, "refused"] == 2
    assert len({kind for _, kind in contributions}) <= MAX_KIND_LABELS + 1
    counts = node.status()["trust"]["counts"]
    assert sum(contributions.values()) == sum(n for per in counts.values() for n in per.values())  # folded, not lost
    assert [s.value for s in samples if s.name == "starling_banned_peers"] == [len(many) + 1]
    per_peer = {s.labels["peer"]: s.value for s in samples if s.name == "starling_peer_banned"}
    assert len(per_peer) == MAX_PEER_LABELS + 1
    assert per_peer.pop(OTHERS) == len(many) + 1 - MAX_PEER_LABELS  # the banned peers past the cap, counted
    assert set(per_peer.values()) == {1}


def test_progress_counts_rounds_and_rounds_that_went_on_without_someone():
    progress = TrainingProgress()
    progress.record(StepReport(step=0, loss=2.0, bytes_sent=100, synced=False))
    progress.record(StepReport(step=1, loss=1.5, bytes_sent=100, synced=True, peers=3))
    progress.record(StepReport(step=2, loss=1.0, bytes_sent=100, synced=True, peers=2, lost_peers=("x",)))
    assert (progress.steps, progress.step, progress.rounds, progress.rounds_incomplete) == (3, 3, 2, 1)
    assert (progress.loss, progress.peers, progress.bytes_sent) == (1.0, 2, 300)
    meta = progress.meta()
    assert meta["step"] == 3 and meta["loss"] == 1.0 and meta["synced"] > 0


def test_a_nan_loss_is_published_as_none_not_refused(make_node):
    node = make_node("inproc")
    progress = TrainingProgress()
    progress.record(StepReport(step=0, loss=math.nan))
    node.set_meta(**progress.meta())  # finite_meta refuses NaN: training must not die of it
    assert node.status()["meta"]["loss"] is None and node.status()["meta"]["synced"] is None


class _Writer:
    def __init__(self, log_dir: str) -> None:
        self.log_dir, self.scalars, self.closed = log_dir, [], False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        self.closed = True


def test_tensorboard_gets_the_progress_lines_numbers(tmp_path):
    log = TensorBoardLog(tmp_path, writer=_Writer)
    progress = TrainingProgress()
    progress.record(StepReport(step=9, loss=0.5, bytes_sent=64, bytes_received=32, synced=True, peers=2))
    log.log(progress)
    progress.record(StepReport(step=10, loss=math.nan))
    log.log(progress)
    log.close()
    writer = log._writer
    assert writer.closed and writer.log_dir == str(tmp_path)
    assert ("train/loss", 0.5, 10) in writer.scalars and ("bytes/sent", 64, 10) in writer.scalars
    assert not [s for s in writer.scalars if s[0] == "train/loss" and s[2] == 11]  # NaN is not drawn


def test_tensorboard_event_file_reads_back(tmp_path):
    pytest.importorskip("tensorboard")  # the optional extra: pip install 'starling[tensorboard]'
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TensorBoardLog(tmp_path)
    progress = TrainingProgress()
    for step in range(3):
        progress.record(StepReport(step=step, loss=1.0 / (step + 1), synced=True, peers=2))
        log.log(progress)
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
