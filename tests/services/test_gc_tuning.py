"""The serving processes' collector settings (`services/common/gc_tuning.py`)."""

import gc

from services.common.gc_tuning import SERVING_THRESHOLDS, freeze_startup_heap


def test_serving_starts_with_a_frozen_heap_and_the_serving_thresholds():
    before = gc.get_threshold()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0, "start-up's objects leave the collector's sight"
        assert gc.get_threshold() == SERVING_THRESHOLDS
        collections = gc.get_stats()[0]["collections"]
        held = [[] for _ in range(5_000)]  # seven young collections' worth at the default 700
        assert gc.get_stats()[0]["collections"] == collections, "a young collection waits for its threshold"
        del held
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
