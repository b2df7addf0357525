"""runtime/drivers/gc_settle.py: the heap alive before serving is frozen out of the collector's walks, and given back."""
from __future__ import annotations

import gc

from runtime.drivers.gc_settle import settle_heap, thaw_heap


def test_settle_freezes_the_survivors_and_thaw_gives_them_back():
    assert gc.get_freeze_count() == 0
    try:
        assert settle_heap() > 0.0
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # at least the modules this test process imported
        assert len(gc.get_objects(2)) < min(1000, frozen // 10)  # the walked oldest generation no longer holds them
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0


def test_a_second_settle_collects_cyclic_garbage_frozen_by_the_first():
    """A workload's engine can die in a reference cycle after the heap was frozen with it alive; the next workload's
    settle must free it (on a GPU it can hold the KV pool)."""
    import weakref

    class Engine:
        pass
    e = Engine()
    e.self_ref = e  # a cycle: reference counting alone never frees it
    alive = weakref.ref(e)
    try:
        settle_heap()
        del e
        gc.collect()
        assert alive() is not None  # frozen: the collector does not look at it
        settle_heap()
        assert alive() is None
    finally:
        thaw_heap()
