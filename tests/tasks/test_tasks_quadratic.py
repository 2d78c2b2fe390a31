from __future__ import annotations

import threading
from collections.abc import Iterator
from itertools import islice

import pytest
import torch

from starling.tasks import QuadraticTask, get_task
from starling.tasks.quadratic import QuadraticConfig


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sgd_step(model: torch.nn.Module, loss: torch.Tensor, lr: float) -> None:
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def quadratic(**options: object) -> QuadraticTask:
    return get_task("quadratic", **options)  # type: ignore[return-value]


def test_model_is_deterministic_vector() -> None:
    task = quadratic(init_scale=1.0)
    a, b = task.make_model(), task.make_model()
    assert a.x.shape == (1000,) and torch.equal(a.x, b.x)
    assert torch.count_nonzero(quadratic().make_model().x) == 0


def test_curvature_has_requested_condition_number() -> None:
    a = quadratic(condition_number=50).curvature()
    assert a.max().item() == pytest.approx(1.0)
    assert (a.max() / a.min()).item() == pytest.approx(50.0)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_peer_optima_average_to_optimum(world: int) -> None:
    task = quadratic()
    optima = torch.stack([task.peer_optimum(r, world) for r in range(world)])
    assert torch.allclose(optima.mean(0), task.optimum(), atol=1e-12)
    if world > 1:
        assert (optima[0] - task.optimum()).std().item() == pytest.approx(1.0, rel=0.2)


def test_batches_deterministic_and_distinct() -> None:
    task = quadratic(noise_std=0.1)
    a = list(islice(task.batches(0, 4, 0), 2))
    b = list(islice(task.batches(0, 4, 0), 2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a[0], next(task.batches(1, 4, 0)))
    assert not torch.equal(a[0], next(task.batches(0, 4, 1)))


def test_noisy_batches_are_unbiased() -> None:
    task = quadratic(dim=50, noise_std=1.0)
    mean = torch.stack(list(islice(task.batches(2, 4, 0), 2000))).double().mean(0)
    assert torch.allclose(mean, task.peer_optimum(2, 4), atol=0.1)


def test_gradient_is_curvature_times_displacement() -> None:
    task = quadratic(dim=20, init_scale=1.0)
    model = task.make_model()
    target = next(task.batches(0, 2, 0))
    loss = task.loss(model, target)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    expected = task.curvature().float() * (model.x.detach() - target)
    assert torch.allclose(model.x.grad, expected, atol=1e-6)


def test_swarm_gradient_descent_reaches_optimum() -> None:
    world = 4
    task = quadratic(condition_number=10.0)
    model = task.make_model()
    streams = [task.batches(r, world, 0) for r in range(world)]
    for _ in range(300):
        sgd_step(model, sum(task.loss(model, next(s)) for s in streams) / world, lr=1.0)
    result = task.evaluate(model)
    assert result["distance"] < 1e-4 and result["eval_loss"] < 1e-9
    assert torch.allclose(model.x.double(), task.optimum(), atol=1e-4)


def test_single_peer_reaches_its_own_optimum() -> None:
    task = quadratic(condition_number=10.0)
    model = task.make_model()
    for batch in islice(task.batches(1, 4, 0), 300):
        sgd_step(model, task.loss(model, batch), lr=1.0)
    assert torch.allclose(model.x.double(), task.peer_optimum(1, 4), atol=1e-4)
    assert task.evaluate(model)["distance"] > 10.0  # far from the swarm's x*


def test_evaluate_is_the_optimality_gap() -> None:
    task = quadratic(dim=10, init_scale=1.0)
    model = task.make_model()
    delta = model.x.detach().double() - task.optimum()
    result = task.evaluate(model)
    assert result["eval_loss"] == pytest.approx(0.5 * (task.curvature() * delta**2).sum().item())
    assert result["distance"] == pytest.approx(delta.norm().item())
    assert model.training
    with torch.no_grad():
        model.x.copy_(task.optimum())
    assert task.evaluate(model)["eval_loss"] < 1e-12


def test_bad_rank_is_rejected_at_once() -> None:
    with pytest.raises(ValueError, match="rank must be in"):
        quadratic().batches(2, 2, 0)


def test_peers_that_start_together_on_threads_share_one_table_of_offsets():
    # a simulator's peers each ask for their target on their own thread, all at once
    task = QuadraticTask(QuadraticConfig(dim=2000))
    start = threading.Barrier(16)
    tables = []

    def ask() -> None:
        start.wait()
        tables.append(task.peer_offsets(512))

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tables) == 16
    assert all(table is tables[0] for table in tables)
