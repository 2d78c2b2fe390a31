from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import pytest
import torch

from starling.tasks import Task, TeacherTask, get_task


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    # Like the simulator: on a busy 2-core box, torch's intra-op thread pool stalls for seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_adam(task: Task, model: torch.nn.Module, batches: Iterable[Any], lr: float) -> None:
    """Plain Adam, written out: torch.optim's first use imports torch._dynamo (seconds)."""
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, batch in enumerate(batches, start=1):
        for p in params:
            p.grad = None
        task.loss(model, batch).backward()
        with torch.no_grad():
            for p, m_p, v_p in zip(params, m, v):
                m_p.mul_(0.9).add_(p.grad, alpha=0.1)
                v_p.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.sub_(lr * (m_p / (1 - 0.9**t)) / ((v_p / (1 - 0.999**t)).sqrt() + 1e-8))


@pytest.fixture(scope="module")
def task() -> TeacherTask:
    return get_task("teacher")  # type: ignore[return-value]


def test_make_model_is_deterministic(task: TeacherTask) -> None:
    torch.manual_seed(1)
    a = task.make_model()
    torch.manual_seed(2)
    b = task.make_model()
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    other = get_task("teacher", seed=1).make_model()
    assert not torch.equal(a[0].weight, other[0].weight)


def test_teacher_is_fixed_and_classes_balanced(task: TeacherTask) -> None:
    x, y = task._eval_set
    assert torch.equal(get_task("teacher").teacher.label(x), y)
    freq = torch.bincount(y, minlength=10).float() / len(y)
    assert freq.min() > 0.5 / 10 and freq.max() < 2.0 / 10


@pytest.mark.parametrize("non_iid", [0.0, 0.7])
def test_batches_deterministic_and_distinct(non_iid: float) -> None:
    task = get_task("teacher", non_iid=non_iid)

    def take(rank: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(islice(task.batches(rank, 4, seed), 3))

    first = take(1, 0)
    for (xa, ya), (xb, yb) in zip(first, take(1, 0)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(first[0][0], take(2, 0)[0][0])
    assert not torch.equal(first[0][0], take(1, 1)[0][0])
    x, y = first[0]
    assert x.shape == (64, 32) and y.shape == (64,) and y.dtype == torch.int64
    assert torch.equal(task.teacher.label(x), y), "labels are the teacher's"


def test_fully_non_iid_peers_see_only_their_classes() -> None:
    task = get_task("teacher", non_iid=1.0)
    for rank in range(4):
        labels = torch.cat([y for _, y in islice(task.batches(rank, 4, 0), 5)])
        assert set(labels.tolist()) <= {c for c in range(10) if c % 4 == rank}
    many = get_task("teacher", non_iid=1.0, num_classes=3)
    _, y = next(many.batches(5, 6, 0))
    assert set(y.tolist()) == {5 % 3}


def test_partial_skew_follows_the_mix() -> None:
    task = get_task("teacher", non_iid=0.5)
    mix = task.label_mix(0, 5)
    assert mix.sum().item() == pytest.approx(1.0)
    labels = torch.cat([y for _, y in islice(task.batches(0, 5, 0), 60)])  # 3840 labels
    freq = torch.bincount(labels, minlength=10).float() / len(labels)
    assert torch.allclose(freq, mix, atol=0.03)
    mean_mix = torch.stack([task.label_mix(r, 5) for r in range(5)]).mean(0)
    assert torch.allclose(mean_mix, torch.full((10,), 0.1))


def test_loss_is_finite_scalar_with_grad(task: TeacherTask) -> None:
    model = task.make_model()
    loss = task.loss(model, next(task.batches(0, 1, 0)))
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_training_lowers_loss_and_raises_accuracy(task: TeacherTask) -> None:
    model = task.make_model()
    before = task.evaluate(model)
    train_adam(task, model, islice(task.batches(0, 2, 0), 60), lr=1e-2)
    after = task.evaluate(model)
    assert after["eval_loss"] < before["eval_loss"] - 0.3
    assert after["eval_accuracy"] > before["eval_accuracy"] + 0.15
    assert 0.0 <= after["eval_accuracy"] <= 1.0


def test_evaluate_keeps_mode(task: TeacherTask) -> None:
    model = task.make_model()
    task.evaluate(model)
    assert model.training
    model.eval()
    task.evaluate(model)
    assert not model.training


def test_bad_rank_is_rejected_at_once(task: TeacherTask) -> None:
    with pytest.raises(ValueError, match="rank must be in"):
        task.batches(-1, 2, 0)
