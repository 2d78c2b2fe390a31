"""Non-IID partitions against Flower's definitions: Dirichlet proportions per class, K label
shards per partition, IID cuts; the teacher task's label mixes; the CLI's one-line refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from starling.cli.main import app
from starling.tasks import get_task
from starling.tasks.partition import Partition


def test_dirichlet_class_proportions_follow_their_definition():
    # 400 classes of 2000 samples over W = 8 partitions, alpha = 0.5: each class's share of a
    # partition is one coordinate of Dirichlet(alpha, ..., alpha): mean 1/W and variance
    # (1/W)(1 - 1/W) / (W alpha + 1)
    classes, per_class, world, alpha = 400, 2000, 8, 0.5
    labels = np.repeat(np.arange(classes), per_class)
    parts = Partition.parse(f"dirichlet:{alpha}").indices(labels, world, seed=3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))  # every sample once
    shares = np.stack([np.bincount(labels[p], minlength=classes) for p in parts]) / per_class  # (W, classes)
    assert np.allclose(shares.sum(0), 1.0)
    mean, var = 1 / world, (1 / world) * (1 - 1 / world) / (world * alpha + 1)
    assert abs(shares.mean() - mean) < 1e-9
    assert abs(shares.var() / var - 1) < 0.1  # 3,200 draws: the sample variance within 10%
    # the same with a large alpha is close to IID, with a small one concentrated
    near_iid = Partition.parse("dirichlet:1000").indices(labels, world, seed=3)
    assert np.stack([np.bincount(labels[p], minlength=classes) for p in near_iid]).std() / per_class < 0.02
    assert (shares.max(0) > 0.5).mean() > 0.2  # alpha 0.5: many classes mostly on one peer
    again = Partition.parse(f"dirichlet:{alpha}").indices(labels, world, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # deterministic for the seed


def test_shards_give_each_partition_k_label_blocks_and_iid_equal_cuts():
    labels = np.repeat(np.arange(20), 100)  # 2000 samples, 20 classes
    parts = Partition.parse("shards:2").indices(labels, 10, seed=1)
    assert [len(p) for p in parts] == [200] * 10  # 20 shards of 100
    assert all(len(np.unique(labels[p])) == 2 for p in parts)  # a shard here is one class
    assert sorted(np.concatenate(parts).tolist()) == list(range(2000))
    iid = Partition.parse("iid").indices(labels, 7, seed=1)
    assert {len(p) for p in iid} <= {285, 286} and sum(len(p) for p in iid) == 2000
    with pytest.raises(ValueError, match="cannot make 40 shards"):
        Partition.parse("shards:4").indices(labels[:30], 10, seed=1)


@pytest.mark.parametrize("spec", ["dirichlet:0", "dirichlet:x", "shards:0", "iid:2", "zipf:1", ""])
def test_a_malformed_partition_is_one_clear_error(spec):
    with pytest.raises(ValueError, match="partition must be iid, dirichlet:ALPHA"):
        Partition.parse(spec)


def test_teacher_peers_draw_labels_from_their_partitions_mix():
    task = get_task("teacher", partition="shards:1", num_classes=10, batch_size=512)
    mixes = torch.stack([task.label_mix(r, 10) for r in range(10)])
    assert torch.allclose(mixes.sum(1), torch.ones(10))
    assert ((mixes > 0).sum(1) == 1).all()  # one shard each: one class each
    _, y = next(task.batches(3, 10, seed=0))
    assert set(y.tolist()) == {int(mixes[3].argmax())}
    assert get_task("teacher", partition="iid").label_mix(0, 4).allclose(torch.full((10,), 0.1))
    with pytest.raises(ValueError, match="partition or non_iid"):
        get_task("teacher", partition="iid", non_iid=0.5)


def test_simulate_partition_refuses_a_task_without_labels_in_one_line():
    result = CliRunner().invoke(app, ["simulate", "--partition", "dirichlet:0.5", "--steps", "2"])
    assert result.exit_code != 0 and "task 'charlm' has no labels to partition" in result.output
