from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import pytest
import torch

from starling.tasks import CharLMConfig, CharLMTask, Task, get_task
from starling.tasks.charlm import UNKNOWN_ID, VOCAB_SIZE, decode, encode, load_corpus

SMALL = {"corpus_chars": 200_000}


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
def task() -> CharLMTask:
    return get_task("charlm", **SMALL)  # type: ignore[return-value]


def test_vocab_is_fixed_and_round_trips() -> None:
    assert VOCAB_SIZE == 98
    text = "def f(x):\n\treturn x ~ 1  # ok"
    ids = encode(text)
    assert ids.dtype == torch.uint8 and len(ids) == len(text)
    assert decode(ids) == text
    assert encode("é€\r\x00").tolist() == [UNKNOWN_ID] * 4


def test_corpus_is_cached_and_capped() -> None:
    corpus = load_corpus(SMALL["corpus_chars"])
    assert load_corpus(SMALL["corpus_chars"]) is corpus
    assert len(corpus) == SMALL["corpus_chars"]
    assert int(corpus.max()) < VOCAB_SIZE
    assert "import" in decode(corpus[:20_000])


def test_make_model_is_deterministic(task: CharLMTask) -> None:
    torch.manual_seed(1)
    a = task.make_model()
    torch.manual_seed(2)  # the global RNG's state must not matter
    b = task.make_model()
    assert a.state_dict().keys() == b.state_dict().keys()
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    other = get_task("charlm", seed=1, **SMALL).make_model()
    assert not torch.equal(a.tok_emb.weight, other.tok_emb.weight)


def test_weight_tying(task: CharLMTask) -> None:
    model = task.make_model()
    assert model.head.weight is model.tok_emb.weight
    untied = get_task("charlm", tie_weights=False, **SMALL).make_model()
    assert untied.head.weight is not untied.tok_emb.weight
    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n_params(untied) == n_params(model) + VOCAB_SIZE * task.config.n_embd


def test_batches_shape_and_shift(task: CharLMTask) -> None:
    x, y = next(task.batches(0, 4, 0))
    cfg = task.config
    assert x.shape == y.shape == (cfg.batch_size, cfg.seq_len)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_deterministic_and_distinct(task: CharLMTask) -> None:
    def take(rank: int, world: int, seed: int) -> list[torch.Tensor]:
        return [x for x, _ in islice(task.batches(rank, world, seed), 3)]

    first = take(1, 4, 7)
    for a, b in zip(first, take(1, 4, 7)):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], take(2, 4, 7)[0])
    assert not torch.equal(first[0], take(1, 4, 8)[0])
    assert not torch.equal(first[0], first[1])


def test_shards_partition_the_training_split(task: CharLMTask) -> None:
    train, held_out = task.splits()
    assert len(held_out) == len(load_corpus(SMALL["corpus_chars"])) - len(train)
    shards = [task.shard(rank, 3) for rank in range(3)]
    assert torch.equal(torch.cat(shards), train)


def test_batches_come_from_own_shard(task: CharLMTask) -> None:
    shard = decode(task.shard(2, 4))
    x, _ = next(task.batches(2, 4, 0))
    for row in x[:4]:
        assert decode(row) in shard


def test_bad_rank_and_tiny_corpus() -> None:
    task = get_task("charlm", **SMALL)
    with pytest.raises(ValueError, match="rank must be in"):
        task.batches(4, 4, 0)
    with pytest.raises(ValueError, match="world must be >= 1"):
        task.batches(0, 0, 0)
    tiny = get_task("charlm", corpus_chars=1000)
    with pytest.raises(ValueError, match="raise corpus_chars"):
        tiny.batches(0, 64, 0)


def test_loss_is_finite_scalar_with_grad(task: CharLMTask) -> None:
    model = task.make_model()
    loss = task.loss(model, next(task.batches(0, 1, 0)))
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(VOCAB_SIZE)) < 0.5  # near-uniform at initialisation
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_training_lowers_loss() -> None:
    task = get_task("charlm", seq_len=32, **SMALL)
    model = task.make_model()
    before = task.evaluate(model)["eval_loss"]
    train_adam(task, model, islice(task.batches(0, 2, 0), 20), lr=1e-2)
    after = task.evaluate(model)
    assert after["eval_loss"] < before - 0.5
    assert after["eval_bits_per_char"] == pytest.approx(after["eval_loss"] / math.log(2))


def test_evaluate_is_deterministic_and_keeps_mode(task: CharLMTask) -> None:
    model = task.make_model()
    assert model.training
    first = task.evaluate(model)
    assert model.training
    assert torch.is_grad_enabled()
    model.eval()
    assert task.evaluate(model) == first
    assert not model.training
    assert get_task("charlm", **SMALL).evaluate(model) == first


def test_generate_extends_context(task: CharLMTask) -> None:
    model = task.make_model()
    prompt = encode("def ").long()[None]
    out = model.generate(prompt, 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 9) and torch.equal(out[:, :4], prompt)


def test_default_config_is_small() -> None:
    cfg = CharLMConfig()
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.seq_len, cfg.batch_size) == (2, 4, 64, 64, 16)
