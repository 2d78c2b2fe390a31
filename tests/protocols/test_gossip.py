"""gossip: topologies, exact pairwise averaging keeps the swarm mean, consensus, CHOCO."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, swarm

from starling.protocols import get_protocol
from starling.protocols.gossip import neighbours
from starling.tasks import get_task

DIM = 512
TASK = get_task("quadratic", dim=DIM)




def spread_swarm(make_node, n: int, options: dict) -> list:
    """n gossip peers whose parameters start far apart (peer r at r-dependent random points)."""
    protos = []
    for rank, node in enumerate(swarm(make_node, n)):
        model = TASK.make_model()
        with torch.no_grad():
            model.x.copy_(torch.randn(DIM, generator=torch.Generator().manual_seed(rank)) * 3)
        protos.append(get_protocol("gossip").create(node, model, options))
    return protos


def run(protos: list, steps: int) -> list:
    """Steps with lr = 0: only gossip moves the parameters."""
    def train(p):
        return [p.step(lambda: TASK.loss(p.model, torch.zeros(DIM))) for _ in range(steps)]
    return in_parallel([lambda p=p: train(p) for p in protos])


def stacked(protos: list) -> torch.Tensor:
    return torch.stack([p.consensus_vector().double() for p in protos])


def distance(xs: torch.Tensor) -> float:
    return float((xs - xs.mean(0)).norm(dim=1).pow(2).mean().sqrt())


def test_topologies():
    m = tuple(f"p{i}" for i in range(8))
    assert neighbours("ring", m, "p0") == ["p1", "p7"]
    assert neighbours("complete", m[:3], "p1") == ["p0", "p2"]
    assert neighbours("exponential", m, "p0") == ["p1", "p2", "p4", "p6", "p7"]
    six = m[:6]  # a 2 x 3 torus
    assert neighbours("torus", six, "p0") == ["p1", "p2", "p3"]
    assert neighbours("torus", six, "p4") == ["p1", "p3", "p5"]
    for topo in ("complete", "ring", "torus", "exponential"):
        assert neighbours(topo, ("a",), "a") == []
        assert neighbours(topo, ("a", "b"), "a") == ["b"]
        for me in m:  # symmetric: j is my neighbour iff I am j's
            assert all(me in neighbours(topo, m, j) for j in neighbours(topo, m, me))


@pytest.mark.parametrize("topology", ["complete", "ring", "torus", "exponential"])
def test_pairwise_averaging_keeps_the_mean_and_reaches_consensus(make_node, topology):
    protos = spread_swarm(make_node, 4, {"lr": 0.0, "topology": topology})
    before = stacked(protos)
    # How many exchanges 8 steps hold depends on timing (a peer pairs with whoever is free):
    # on a starved box, a few more rounds of 8, until the spread halves (usually the first).
    reports: list = []
    for _ in range(8):
        reports += [r for rs in run(protos, 8) for r in rs]
        if distance(stacked(protos)) < 0.5 * distance(before):
            break
    after = stacked(protos)
    torch.testing.assert_close(after.mean(0), before.mean(0), rtol=0, atol=1e-5)
    assert distance(after) < 0.5 * distance(before), (distance(before), distance(after))
    assert any(r.synced and r.bytes_sent > 0 for r in reports)


def test_one_exchange_makes_the_pair_equal_to_its_mean(make_node):
    a, b = spread_swarm(make_node, 2, {"lr": 0.0})
    xa, xb = a.consensus_vector(), b.consensus_vector()
    report = a.step(lambda: TASK.loss(a.model, torch.zeros(DIM)))
    assert report.synced and report.peers == 2
    torch.testing.assert_close(a.consensus_vector(), (xa + xb) / 2)
    torch.testing.assert_close(b.consensus_vector(), (xa + xb) / 2)


def test_local_steps_space_out_exchanges(make_node):
    a, b = spread_swarm(make_node, 2, {"lr": 0.0, "local_steps": 3})
    reports = [a.step(lambda: TASK.loss(a.model, torch.zeros(DIM))) for _ in range(6)]
    assert [r.synced for r in reports] == [False, False, True, False, False, True]
    assert reports[0].bytes_sent == 0


def test_choco_with_compression_reaches_consensus(make_node):
    protos = spread_swarm(make_node, 4, {"lr": 0.0, "topology": "ring", "compressor": "topk:0.1",
                                        "mixing": 0.3})
    before = stacked(protos)
    reports = run(protos, 40)
    after = stacked(protos)
    assert distance(after) < 0.25 * distance(before), (distance(before), distance(after))
    # Asynchronous CHOCO is not exactly mean-preserving (a peer mixes with neighbours'
    # public copies as they stand when it steps, and skips one whose pull timed out); measured
    # drift is 10-27% of the start's spread on a quiet box, 47% with four test workers on two
    # cores. A mean that runs away (a sign or a scale wrong) drifts by the spread or more.
    assert float((after.mean(0) - before.mean(0)).norm()) < 0.6 * distance(before)
    assert reports[0][-1].synced
    # the first exchange sends full public copies, later ones only the compressed updates
    assert reports[0][-1].bytes_sent < 0.4 * reports[0][0].bytes_sent


def test_dead_neighbour_is_skipped_and_reported(make_node):
    a, b = spread_swarm(make_node, 2, {"lr": 0.0, "pull_timeout_s": 1.0})
    b.node.close()
    report = a.step(lambda: TASK.loss(a.model, torch.zeros(DIM)))
    assert not report.synced and report.lost_peers == (b.node.peer_id,)


def predicted_per_round(topology: str, deviations: torch.Tensor, rounds: int) -> float:
    """Randomized pairwise gossip (Boyd et al. 2006): one exchange of i (picked uniformly)
    with a uniform neighbour j is the projection W = I - (e_i - e_j)(e_i - e_j)^T / 2, so
    E||W x - mean||^2 = x^T (I - M) x with M = E[(e_i - e_j)(e_i - e_j)^T / 2]. Along M's
    eigenvectors a component shrinks by (1 - mu_k) per exchange, n exchanges a round; the
    prediction for this start is the energy-weighted sum over the components."""
    n = deviations.shape[0]
    members = tuple(f"p{i}" for i in range(n))
    m = torch.zeros(n, n, dtype=torch.float64)
    for i, me in enumerate(members):
        nbrs = neighbours(topology, members, me)
        for other in nbrs:
            e = torch.zeros(n, dtype=torch.float64)
            e[i], e[members.index(other)] = 1.0, -1.0
            m += torch.outer(e, e) / 2 / (n * len(nbrs))
    mu, vectors = torch.linalg.eigh(m)
    energy = (vectors.T @ deviations).pow(2).sum(1)
    after = float((energy * (1 - mu).pow(n * rounds)).sum())
    return (after / float(energy.sum())) ** (1 / rounds)


@pytest.mark.slow
def test_consensus_distance_shrinks_at_the_rate_theory_predicts(make_node):
    n, rounds = 8, 6
    measured, predicted = {}, {}
    for topology in ("ring", "complete"):
        protos = spread_swarm(make_node, n, {"lr": 0.0, "topology": topology})
        start = stacked(protos)
        run(protos, rounds)
        measured[topology] = (distance(stacked(protos)) / distance(start)) ** (2 / rounds)
        predicted[topology] = predicted_per_round(topology, start - start.mean(0), rounds)
        for p in protos:
            p.close()
    for topology, rate in measured.items():
        # Concurrent peers sometimes find a neighbour busy and skip an exchange (a round
        # then does fewer than n), and one run of 6 rounds is one sample of a random process
        # (seen: 0.43 to 0.54 per round on the ring against a predicted 0.60).
        assert predicted[topology] ** 2.5 <= rate <= predicted[topology] ** 0.4, (topology, rate, predicted)
    # No check that complete beat ring in this one sample: their bands overlap at n = 8, and
    # a loaded CI run measured ring 0.457 against complete 0.493.
