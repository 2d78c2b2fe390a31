"""Protocols on a swarm of two public peers and two clients (peers nobody can dial), over real
CURVE sockets: the sharded all-reduce places shards on the public peers only, so nothing of
it is relayed; gossip and SPSA run unchanged, client-to-client traffic going through relays."""
from __future__ import annotations

import pytest
import torch
from conftest import TEST_LIVENESS, in_parallel, wait_until

from starling.node.node import Node, NodeConfig
from starling.node.relay import VIA
from starling.protocols import get_protocol
from starling.tasks import get_task

DIM = 256
TASK = get_task("quadratic", dim=DIM)
CONFIG = NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0)


@pytest.fixture
def mixed():
    """[public, public, client, client], all alive to each other, clients attached to both relays."""
    made: list[Node] = []

    def start(listen: str | None, join: list[str]) -> Node:
        node = Node(config=CONFIG)
        made.append(node)
        return node.start(listen, join)

    seed = start("tcp://127.0.0.1:0", [])
    nodes = [seed, start("tcp://127.0.0.1:0", [seed.address]), start(None, [seed.address]),
             start(None, [seed.address])]
    for node in nodes:
        assert wait_until(lambda node=node: len(node.live_peers()) == 3)
    for c in nodes[2:]:
        assert wait_until(lambda c=c: c.status()["meta"].get(VIA, "").count(",") == 1)
    yield nodes
    for node in made:
        node.close()


def _models(n: int) -> list[torch.nn.Module]:
    models = []
    for rank in range(n):
        model = TASK.make_model()
        with torch.no_grad():
            model.x.copy_(torch.randn(DIM, generator=torch.Generator().manual_seed(rank)) * 3)
        models.append(model)
    return models


def _relayed(nodes: list[Node]) -> int:
    return sum(n.stats.total_received("$relay") for n in nodes[:2])


def _same_models(n: int) -> list[torch.nn.Module]:
    template = TASK.make_model()
    models = []
    for _ in range(n):
        model = TASK.make_model()
        model.load_state_dict(template.state_dict())
        models.append(model)
    return models


def test_allreduce_shards_sit_on_public_peers_and_nothing_is_relayed(mixed):
    # a shard per reachable member (the default would put this small model on one owner)
    protos = [get_protocol("allreduce").create(n, m, {"lr": 0.1, "min_shard_numel": 1})
              for n, m in zip(mixed, _same_models(4))]
    start = protos[0].model.x.detach().clone()
    relayed = _relayed(mixed)
    batches = [torch.randn(DIM, generator=torch.Generator().manual_seed(rank)) for rank in range(4)]
    for _ in range(2):
        reports = in_parallel([lambda p=p, b=b: p.step(lambda: TASK.loss(p.model, b))
                               for p, b in zip(protos, batches)])
        assert all(r.peers == 4 and r.synced for r in reports)
    xs = [p.model.x.detach() for p in protos]  # different batches, averaged gradients: one model
    assert all(torch.equal(x, xs[0]) for x in xs) and not torch.equal(xs[0], start)
    assert _relayed(mixed) == relayed
    for client in mixed[2:]:  # its parts went to the two public owners only
        sent = client.stats.snapshot()["bytes_sent"]
        talked_to = {p for p, topics in sent.items() if any(not t.startswith("$") for t in topics)}
        assert talked_to == {mixed[0].peer_id, mixed[1].peer_id}


def test_gossip_reaches_consensus_with_clients_through_relays(mixed):
    protos = [get_protocol("gossip").create(n, m, {"lr": 0.0, "topology": "complete"})
              for n, m in zip(mixed, _models(4))]
    stacked = torch.stack([p.consensus_vector().double() for p in protos])
    mean, spread = stacked.mean(0), (stacked - stacked.mean(0)).norm()
    for _ in range(8):
        in_parallel([lambda p=p: [p.step(lambda: TASK.loss(p.model, torch.zeros(DIM))) for _ in range(8)]
                     for p in protos])
        now = torch.stack([p.consensus_vector().double() for p in protos])
        if (now - now.mean(0)).norm() < 0.5 * spread:
            break
    torch.testing.assert_close(now.mean(0), mean, rtol=0, atol=1e-5)
    assert (now - now.mean(0)).norm() < 0.5 * spread
    client_pairs = mixed[2].stats.snapshot()["bytes_sent"].get(mixed[3].peer_id, {})
    if any(not t.startswith("$") for t in client_pairs):  # the two clients gossiped with each other
        assert _relayed(mixed) > 0


def test_spsa_peers_stay_identical_with_clients(mixed):
    models = _same_models(4)
    start = models[0].x.detach().clone()
    protos = [get_protocol("spsa").create(n, m, {"lr": 0.05, "eps": 1e-2, "round_timeout_s": 5.0})
              for n, m in zip(mixed, models)]
    batch = torch.ones(DIM)  # away from x: a slope for the perturbations to find
    for _ in range(3):
        in_parallel([lambda p=p: p.step(lambda: TASK.loss(p.model, batch)) for p in protos])
    xs = [p.model.x.detach() for p in protos]
    assert all(torch.equal(x, xs[0]) for x in xs)
    assert not torch.equal(xs[0], start)
