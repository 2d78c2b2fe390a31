import gc
import threading
import weakref

import pytest

from starling.common.heap import building_heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _restore_collector():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_inside_the_block_the_automatic_collector_is_off_and_young_garbage_cycles_are_still_freed():
    gc.enable()
    freed = threading.Event()
    with building_heap(young_every_s=0.01):
        assert not gc.isenabled()
        garbage = Cycle()
        weakref.finalize(garbage, freed.set)
        del garbage
        assert freed.wait(10), "the young pass never freed a garbage cycle made inside the block"


def test_leaving_the_block_frees_cycles_that_died_after_their_young_pass_freezes_the_rest_and_resumes():
    gc.enable()
    freed = threading.Event()
    frozen_before = gc.get_freeze_count()
    with building_heap(young_every_s=3600):  # no young pass while the block runs
        kept = [Cycle() for _ in range(100)]
        garbage = Cycle()
        weakref.finalize(garbage, freed.set)
        del garbage
        assert not freed.is_set()
    assert freed.is_set(), "the cycle that became garbage inside the block outlived it"
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen_before + len(kept)


def test_a_collector_turned_off_before_the_block_stays_off_after_it():
    gc.disable()
    with building_heap(young_every_s=0.01):
        pass
    assert not gc.isenabled()


def test_the_young_pass_ends_and_the_collector_resumes_when_the_block_raises():
    gc.enable()
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(RuntimeError), building_heap(young_every_s=0.01):
        assert "heap-young-gc" in {t.name for t in threading.enumerate()} - before
        raise RuntimeError("boom")
    assert gc.isenabled()
    assert "heap-young-gc" not in {t.name for t in threading.enumerate()} - before


def test_without_freezing_the_heap_built_stays_collectable_once_it_is_garbage():
    gc.enable()
    freed = threading.Event()
    frozen_before = gc.get_freeze_count()
    with building_heap(young_every_s=0.01, freeze=False):
        built = Cycle()
        weakref.finalize(built, freed.set)
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen_before
    del built
    gc.collect()
    assert freed.is_set(), "a heap built without freezing was not freed once it was garbage"
