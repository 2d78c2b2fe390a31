"""Checks of DiLoCo's pseudo-gradients by the loss they take off their author's stated batches
against batches it had not seen (protocols/verification.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import in_parallel, swarm, wait_until
from torch import nn

from starling.common import derive_seed
from starling.protocols import get_protocol
from starling.protocols.verification import UNVERIFIED, Verdicts, margin

SHARE = 4  # a checker owns 1/SHARE of the fragment's values: it moves only those


class Regression:
    """A small model on noisy regression batches, each batch its own draw."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 8))
        self.teacher = nn.Linear(16, 8)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-2)

    def batch(self, shard: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(derive_seed("test.batch", shard, index) % (1 << 62))
        x = torch.randn(8, 16, generator=g)
        with torch.no_grad():
            return x, self.teacher(x) + torch.randn(8, 8, generator=g)

    def loss_fn(self, shard: int, index: int):
        x, y = self.batch(shard, index)
        return lambda: nn.functional.mse_loss(self.model(x), y)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def write(self, values: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(values[at:at + p.numel()].view_as(p))
                at += p.numel()

    def inner(self, shard: int, indices: range) -> None:
        for i in indices:
            self.optimizer.zero_grad()
            self.loss_fn(shard, i)().backward()
            self.optimizer.step()

    def check(self, start: torch.Tensor, delta: torch.Tensor, first: int, last: int, batches: int = 4):
        """The check a member owning the first 1/SHARE of the values makes of `delta`."""
        moved = start.clone()
        own = slice(0, start.numel() // SHARE)
        moved[own] -= delta[own]
        picked = [first + j % (last - first + 1) for j in range(batches)]
        unseen = [last + 1 + j for j in range(batches)]
        return margin(lambda where: self.write(moved if where == "author" else start), [self.loss_fn(0, i) for i in picked],
                      [self.loss_fn(0, i) for i in unseen])


def _rounds(task: Regression, rounds: int, steps: int, trained_on):
    """`rounds` DiLoCo rounds of `steps` inner steps on shard 0; each round's pseudo-gradient is
    computed on `trained_on(first, last)` (a shard and its batches) and checked against the
    batches first..last of shard 0; the outer step takes the honest pseudo-gradient (lr 1)."""
    for r in range(rounds):
        first, last = r * steps, r * steps + steps - 1
        start, state = task.flat(), copy.deepcopy(task.optimizer.state_dict())
        task.inner(*trained_on(first, last))
        delta = start - task.flat()
        yield task.check(start, delta, first, last)
        task.write(start)
        task.optimizer.load_state_dict(copy.deepcopy(state))
        task.inner(0, range(first, last + 1))


@pytest.mark.slow
def test_an_honest_pseudo_gradient_passes_its_check_1000_times_in_a_row():
    task = Regression()
    margins = list(_rounds(task, 1000, 4, lambda first, last: (0, range(first, last + 1))))
    failed = [k for k, m in enumerate(margins) if not m.passed]
    assert not failed, (failed[:5], [margins[k] for k in failed[:5]])


def test_a_pseudo_gradient_of_other_data_fails_and_its_author_is_accused():
    """Trained on another shard's batches while the recipe names shard 0's: its margin is noise
    around 0, so about half its checks fail, and the running test accuses it."""
    task = Regression()
    verdicts = Verdicts()
    accused_at = None
    margins = []
    for k, m in enumerate(_rounds(task, 200, 4, lambda first, last: (1, range(first, last + 1)))):
        margins.append(m)
        if verdicts.add("liar", m.passed) and accused_at is None:
            accused_at = k
    failed = sum(not m.passed for m in margins)
    assert 0.3 * len(margins) < failed < 0.7 * len(margins), failed
    assert accused_at is not None and accused_at < 60, accused_at


def test_the_running_test_accuses_once_per_crossing_and_forgets_slowly():
    verdicts = Verdicts(threshold=2.0, drift=0.5)
    assert [verdicts.add("a", False) for _ in range(3)] == [False, True, False]
    assert verdicts.statistic["a"] == 3.0 and verdicts.failed["a"] == 3
    for _ in range(6):
        verdicts.add("a", True)
    assert verdicts.statistic["a"] == 0.0  # never below 0
    honest = Verdicts()
    assert not any(honest.add("h", k % 10 != 0) for k in range(1000))  # one failure in 10 never accumulates
    with pytest.raises(ValueError):
        Verdicts(threshold=0.0)


WORLD = 4


class Data:
    """`audit_data` as a runtime gives it; `stated` is the shard the recipe names."""

    seed = 0

    def __init__(self, proto, task: Regression, rank: int, stated: int | None = None) -> None:
        self.proto, self.task, self.rank, self.index = proto, task, rank, -1
        self.stated = rank if stated is None else stated

    def recipe(self) -> tuple[int, int, int]:
        return self.stated, WORLD, self.index

    def loss_fn(self, rank: int, world: int, index: int):
        x, y = self.task.batch(rank, index)
        return lambda: nn.functional.mse_loss(self.proto.model(x), y)

    def step(self):
        self.index += 1
        x, y = self.task.batch(self.rank, self.index)
        return self.proto.step(lambda: nn.functional.mse_loss(self.proto.model(x), y))


def _diloco_swarm(make_node, liar: int | None = None):
    nodes = swarm(make_node, WORLD)
    task = Regression()
    options = {"lr": 1e-2, "sync_every": 4, "fragments": 2, "overlap_steps": 1, "verify_rate": 1.0,
               "round_timeout_s": 3.0, "reply_grace_s": 0.5}
    protos = [get_protocol("streaming-diloco").create(n, copy.deepcopy(task.model), options) for n in nodes]
    data = []
    for rank, proto in enumerate(protos):
        proto.audit_data = Data(proto, task, rank, stated=(rank + 1) % WORLD if rank == liar else None)
        data.append(proto.audit_data)
    return nodes, protos, data


def test_honest_diloco_members_are_never_accused(make_node):
    """A check sees 1/4 of a fragment here (a few hundred values of this small model), where a
    margin is noisier than in a model of millions: a check may fail now and then, and the
    running test never accuses on that."""
    nodes, protos, data = _diloco_swarm(make_node)
    for _ in range(40):
        in_parallel([d.step for d in data])
    counts = [p.verifier.counts for p in protos]
    verified = sum(c["verified"] for c in counts)
    assert verified >= 40 and not any(c["verify_skipped"] for c in counts), counts
    assert sum(c["verify_failed"] for c in counts) <= verified // 5, counts
    assert not any(n.trust.banned for n in nodes)
    assert not any(k.startswith("accused.") for n in nodes for c in n.trust.counts.values() for k in c)


def test_a_diloco_member_whose_recipe_names_data_it_did_not_train_on_is_banned(make_node):
    liar = 1
    nodes, protos, data = _diloco_swarm(make_node, liar)
    liar_id = nodes[liar].peer_id
    honest = [n for k, n in enumerate(nodes) if k != liar]
    for _ in range(200):
        in_parallel([d.step for k, d in enumerate(data) if not any(nodes[k].peer_id in n.trust.banned for n in honest)])
        if all(liar_id in n.trust.banned for n in honest):
            break
    assert wait_until(lambda: all(liar_id in n.trust.banned for n in honest))
    assert all(n.trust.banned[liar_id].kind == UNVERIFIED for n in honest)
    assert not any(h.peer_id in n.trust.banned for h in honest for n in honest)
    assert not any(nodes[k].peer_id in p.node.trust.banned for k in range(WORLD) if k != liar for p in protos)
