"""benchmarks/federated.py's cut: each member's folder holds the units the Dirichlet partition
gives it, every training unit in exactly one folder, and none of the held-out text."""
from __future__ import annotations

from conftest import load_benchmark


def test_the_cut_gives_every_training_unit_to_exactly_one_member(tmp_path):
    from starling.tasks import get_task

    bench = load_benchmark("federated")
    corpus = bench.write_corpus(tmp_path / "corpus", 12)
    cache = tmp_path / "cache"
    folders = bench.cut(corpus, cache, 3, 0.5, 0, tmp_path / "members")
    units = [int(p.stem.split("-")[1]) for folder in folders for p in folder.iterdir()]
    task = get_task("gpt", **bench.task_options(corpus, cache, partition="dirichlet:0.5"))
    training = len(task.unit_labels())  # a label per training unit
    assert sorted(units) == list(range(training))  # each once, the held-out units in no folder
    for rank, folder in enumerate(folders):
        mine = sorted(int(p.stem.split("-")[1]) for p in folder.iterdir())
        assert mine == task.partition_units(rank, 3, 0).tolist()
        assert all(p.read_text() for p in folder.iterdir())
