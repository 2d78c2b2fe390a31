"""Non-IID partitions against Flower's definitions: Dirichlet proportions per class, K label
shards per partition, IID cuts; the teacher task's label mixes; the CLI's one-line refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from starling.cli.main import app
from starling.tasks import get_task
from starling.tasks.charlm import _corpus_files as charlm_files
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
    result = CliRunner().invoke(app, ["simulate", "--task", "quadratic", "--partition", "dirichlet:0.5",
                                      "--steps", "2"])
    assert result.exit_code != 0 and "task 'quadratic' has no labels to partition" in result.output
    result = CliRunner().invoke(app, ["simulate", "--task", "teacher", "--partition", "iid", "--partition-by",
                                      "folder", "--steps", "2"])
    assert result.exit_code != 0 and "--partition-by goes with --data" in result.output
    result = CliRunner().invoke(app, ["simulate", "--partition-by", "folder", "--steps", "2"])
    assert result.exit_code != 0 and "--partition-by goes with --partition" in result.output


def test_charlm_peers_read_windows_from_the_files_their_partition_gives_them():
    task = get_task("charlm", partition="shards:1", corpus_chars=200_000, seq_len=32, batch_size=64)
    labels = task.block_labels()
    assert len(np.unique(labels)) > 4  # several stdlib files
    train, _ = task.splits()
    starts = np.concatenate([[0], np.cumsum([len(t) for t in charlm_files(200_000)])])
    k = len(labels) // 2  # a block starts in the file whose span holds its first character
    assert starts[labels[k]] <= k * 32 < starts[labels[k] + 1]
    for rank in range(4):
        blocks = task.partition_blocks(rank, 4, seed=0)
        x, y = next(task.batches(rank, 4, seed=0))
        assert x.shape == (64, 32) and torch.equal(x[:, 1:], y[:, :-1])
        allowed = {tuple(train[b * 32:b * 32 + 32].tolist()) for b in blocks.tolist()}
        assert all(tuple(row.tolist()) in allowed for row in x)  # windows start at this peer's blocks only
    owned = [task.partition_blocks(r, 4, seed=0) for r in range(4)]
    files = [set(labels[blocks].tolist()) for blocks in owned]
    # shards:1: a quarter of the blocks sorted by file each, so two peers share a file at most
    # where one's shard ends and the other's begins
    assert all(len(files[r] & files[s]) <= 1 for r in range(4) for s in range(r + 1, 4))
    owned = np.concatenate(owned)
    assert len(np.unique(owned)) == len(owned)  # no block on two peers


def _document_head(row: torch.Tensor) -> bytes:
    """A row's bytes before its first end-of-document id: text of the document it starts in."""
    ids = row.tolist()
    return bytes(ids[:ids.index(256)] if 256 in ids else ids)


def test_corpus_units_are_partitioned_by_folder_and_each_peer_trains_only_its_own(tmp_path):
    corpus = tmp_path / "corpus"
    for topic, word in (("birds", "wren "), ("fish", "carp "), ("trees", "oak ")):
        (corpus / topic).mkdir(parents=True)
        for i in range(3):
            (corpus / topic / f"{i}.txt").write_text(word * (300 + 40 * i))
    task = get_task("gpt", data=str(corpus), seq_len=16, batch_size=2, n_embd=16, n_layer=1,
                    cache_dir=str(tmp_path / "tokens"), partition="shards:1", partition_by="folder")
    assert task.data_units() is None  # no swarm ledger: each peer its own units
    labels = task.unit_labels()
    assert set(labels.tolist()) == {0, 1, 2}  # birds, fish, trees, in path order
    words = [b"wren", b"carp", b"oak"]
    checked = 0
    for unit in range(len(labels)):  # the text a unit starts with is its label's
        head = _document_head(task.unit_batch(unit)[0][0])
        if len(head) >= 8:
            assert [w in head for w in words] == [i == labels[unit] for i in range(3)]
            checked += 1
    assert checked > len(labels) // 2
    mine = [task.partition_units(r, 3, seed=0) for r in range(3)]
    assert sorted(np.concatenate(mine).tolist()) == list(range(len(labels)))
    # shards:1 over 3 peers: a third of the units sorted by topic each, so mostly one topic each
    dominant = [np.bincount(labels[m], minlength=3) / len(m) for m in mine]
    assert sorted(int(d.argmax()) for d in dominant) == [0, 1, 2] and min(d.max() for d in dominant) > 0.8
    seen = {tuple(x[0].tolist()) for x, _ in (next(it) for it in [task.batches(1, 3, 0)] for _ in range(8))}
    theirs = {tuple(task.unit_batch(int(u))[0][0].tolist()) for u in mine[1]}
    assert seen <= theirs


def test_a_table_is_partitioned_by_a_column_and_a_missing_one_is_named(tmp_path):
    import json

    rows = [{"text": ("north " if i % 2 else "south ") * (40 + i), "region": "n" if i % 2 else "s"}
            for i in range(40)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    pytest.importorskip("datasets")
    options = dict(data=str(path), seq_len=16, batch_size=2, n_embd=16, n_layer=1, cache_dir=str(tmp_path / "t"))
    task = get_task("gpt", partition="dirichlet:0.3", partition_by="region", **options)
    labels = task.unit_labels()
    assert set(labels.tolist()) == {0, 1}  # "n" then "s"
    heads = [(_document_head(task.unit_batch(u)[0][0]), labels[u]) for u in range(len(labels))]
    heads = [(head, label) for head, label in heads if len(head) >= 6]
    assert len(heads) > len(labels) // 2
    assert all((b"r" in head, b"u" in head) == (label == 0, label == 1) for head, label in heads)
    parts = [task.partition_units(r, 4, seed=2) for r in range(4)]
    assert all(len(p) for p in parts) and sum(len(p) for p in parts) == len(labels)
    with pytest.raises(ValueError, match="no column 'colour' to partition by; its other columns are region"):
        get_task("gpt", partition="iid", partition_by="colour", **options).data_units()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("plain text " * 300)
    options["data"] = str(tmp_path / "plain")
    with pytest.raises(ValueError, match="partitioned by 'document' or 'folder'"):
        get_task("gpt", partition="iid", partition_by="region", **options).data_units()
