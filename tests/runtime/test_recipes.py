"""Batch recipes for audits: a member's batch by (rank, world, index), and the index a Trainer states."""
from __future__ import annotations

import itertools

import torch

from starling.runtime.recipes import BatchRecipes
from starling.tasks import get_task

TINY = {"corpus_chars": 20_000, "n_layer": 1, "n_embd": 16, "seq_len": 16, "batch_size": 4, "eval_batches": 1}


def nth(task, rank: int, world: int, seed: int, index: int):
    return next(itertools.islice(task.batches(rank, world, seed), index, None))


def test_a_recipe_names_the_batch_the_shard_gives_at_that_index():
    task = get_task("charlm", **TINY)
    recipes = BatchRecipes(task, 7, 0, 4, lambda: 0, lambda batch: lambda: batch, max_ahead=50)
    for rank, index in [(2, 5), (2, 5), (2, 9), (2, 3), (1, 0), (3, 50)]:  # again, forward, back, others
        got = recipes.batch(rank, 4, index)
        want = nth(task, rank, 4, 7, index)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (rank, index)
    assert recipes.batch(0, 4, 51) is None  # past max_ahead from a fresh stream: bounded work
    assert recipes.batch(0, 10**9, 0) is None  # a shard the task cannot cut
    assert torch.equal(recipes.loss_fn(1, 4, 2)()[0], nth(task, 1, 4, 7, 2)[0])


def test_recipe_states_the_index_of_the_batch_being_trained():
    index = [0]
    recipes = BatchRecipes(get_task("charlm", **TINY), 0, 1, 4, lambda: index[0], lambda batch: lambda: batch)
    index[0] = 12
    assert recipes.recipe() == (1, 4, 12)
