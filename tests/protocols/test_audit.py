"""allreduce audits by recomputation: honest peers always pass, forged gradients are caught by
their auditors and banned once two of them accuse, and every peer picks the same pairs."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, swarm, wait_until
from torch import nn

from starling.protocols import get_protocol
from starling.protocols.audit import MISMATCH
from starling.runtime import Simulation
from starling.runtime.simconfig import SimConfig

WORLD = 4
TINY_CHARLM = {"corpus_chars": 20_000, "n_layer": 1, "n_embd": 16, "seq_len": 16, "batch_size": 4,
               "eval_batches": 1}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + index)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


class Data:
    """A protocol's `audit_data` as a runtime gives it: its own batch recipe, any member's batch."""

    seed = 0

    def __init__(self, proto, rank: int) -> None:
        self.proto, self.rank, self.index = proto, rank, -1

    def recipe(self) -> tuple[int, int, int]:
        return self.rank, WORLD, self.index

    def loss_fn(self, rank: int, world: int, index: int):
        x, y = batch(rank, index)
        return lambda: nn.functional.mse_loss(self.proto.model(x), y)

    def step(self):
        self.index += 1
        x, y = batch(self.rank, self.index)
        return self.proto.step(lambda: nn.functional.mse_loss(self.proto.model(x), y))


def audited_swarm(make_node, **options):
    nodes = swarm(make_node, WORLD)
    options = {"lr": 0.05, "audit_rate": 1.0, "round_timeout_s": 3.0, "reply_grace_s": 0.5, **options}
    protos = [get_protocol("allreduce").create(n, mlp(), options) for n in nodes]
    data = []
    for rank, proto in enumerate(protos):
        proto.audit_data = Data(proto, rank)
        data.append(proto.audit_data)
    return nodes, protos, data


def test_whom_a_member_audits_is_drawn_after_the_round_from_its_own_randomness(make_node):
    """Two swarms run alike, every seed the swarm knows set alike, audit other authors: nothing
    an author knows before it sends its parts tells it whether, or by whom, it is audited."""
    drawn = []
    for _ in range(2):
        torch.manual_seed(0)
        nodes, protos, data = audited_swarm(make_node)
        audited: list[tuple[int, str]] = []
        auditor = protos[0].auditor
        audit = auditor._audit
        ids = tuple(n.peer_id for n in nodes)

        def spy(t, author, *args, audit=audit, audited=audited, ids=ids):
            audited.append((t, ids.index(author)))
            return audit(t, author, *args)
        auditor._audit = spy
        for _ in range(8):
            in_parallel([d.step for d in data])
        assert all(0 < a < WORLD for _, a in audited) and len(audited) == 8  # rate 1: one other a round
        drawn.append(audited)
        for node in nodes:
            node.close()
    assert drawn[0] != drawn[1]


def test_honest_peers_pass_every_audit_and_stay_identical(make_node):
    nodes, protos, data = audited_swarm(make_node)
    for _ in range(10):
        in_parallel([d.step for d in data])
    for proto in protos:
        info = proto.describe()
        assert info["audits"] > 0 and info["audit_failed"] == 0 and info["audit_skipped"] == 0, info
        for a, b in zip(proto.model.parameters(), protos[0].model.parameters()):
            assert torch.equal(a, b)
    assert sum(p.describe()["audits"] for p in protos) >= 10 * WORLD - 4  # nearly every pair, every round
    for proto in protos:  # what owners kept for audits was taken, round by round
        assert not proto.reducer.retention.holding
    for node in nodes:
        assert not node.trust.banned
        assert not any(k.startswith("accused.") or k == "audit_failed" for c in node.trust.counts.values() for k in c)


@pytest.mark.parametrize("forge", ["negated", "scaled", "zeros"])
def test_a_forged_gradient_is_caught_and_banned_once_two_auditors_accuse_it(make_node, forge):
    nodes, protos, data = audited_swarm(make_node)
    liar, honest = protos[1], [p for i, p in enumerate(protos) if i != 1]
    start = liar.reducer.start

    def forged(t, members, vector, *args, **kwargs):
        if forge == "negated":
            vector.neg_()
        elif forge == "scaled":
            vector.mul_(10.0)
        else:
            vector.zero_()
        return start(t, members, vector, *args, **kwargs)

    liar.reducer.start = forged
    liar_id = liar.node.peer_id
    for _ in range(30):
        in_parallel([d.step for d in data])
        if all(p.node.trust.is_banned(liar_id) for p in honest):
            break
    assert all(wait_until(lambda p=p: p.node.trust.is_banned(liar_id), 5.0) for p in honest)
    for proto in honest:
        ban = proto.node.trust.banned[liar_id]
        assert ban.kind == MISMATCH and not ban.verifiable and len(ban.witnesses) >= 2
        assert liar_id not in proto.node.live_peers()
        assert not (set(proto.node.trust.banned) - {liar_id})  # no honest peer is accused into a ban
    auditors = [p for p in honest if p.describe()["audit_failed"] > 0]
    assert len(auditors) >= 2
    for proto in auditors:
        assert proto.node.trust.counts[liar_id]["audit_failed"] >= 1
    # honest peers never failed each other's audits
    for proto in honest:
        for peer, counts in proto.node.trust.counts.items():
            if peer != liar_id:
                assert "audit_failed" not in counts, (peer, dict(counts))


def test_audits_need_a_lossless_compressor():
    with pytest.raises(Exception, match="lossless"):
        get_protocol("allreduce").config_class(audit_rate=0.5, compressor="fp16")
    with pytest.raises(Exception, match="audit_rate"):
        get_protocol("allreduce").config_class(audit_rate=1.5)


def test_simulated_honest_swarm_on_charlm_passes_every_audit():
    """Through the Trainer: its batch recipes (rank, world, index), charlm's batches, the loss as
    the runtime builds it."""
    result = Simulation(SimConfig(peers=WORLD, protocol="allreduce", steps=8, task="charlm",
                                  task_options=TINY_CHARLM, options={"audit_rate": 1.0, "lr": 0.05},
                                  transport="inproc")).run()
    infos = [p.protocol_info for p in result.peers]
    assert all(p.status == "finished" for p in result.peers), [(p.status, p.error) for p in result.peers]
    assert all(i["audit_failed"] == 0 and i["audit_skipped"] == 0 for i in infos), infos
    assert sum(i["audits"] for i in infos) >= 8 * WORLD - 4
    assert len({p.eval_loss for p in result.peers}) == 1  # the same parameters everywhere


def test_an_honest_peer_at_other_parameters_is_skipped_not_failed(make_node):
    """A drifted peer (until the drift guard repairs it) computed an honest gradient at other
    parameters: its auditors skip it and count it, and nobody is accused."""
    nodes, protos, data = audited_swarm(make_node, check_every=0)
    drifted = protos[2]
    with torch.no_grad():
        next(drifted.model.parameters()).add_(1e-3)
    for _ in range(6):
        in_parallel([d.step for d in data])
    assert sum(p.describe()["audit_skipped"] for p in protos) > 0
    for proto in protos:
        assert proto.describe()["audit_failed"] == 0
        assert not proto.node.trust.banned
    others = [p for p in protos if p is not drifted]
    assert any(p.node.trust.counts[drifted.node.peer_id]["audit.other_parameters"] > 0 for p in others)
