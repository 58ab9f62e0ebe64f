"""The serving process's garbage collector (core/runtime/gc_heap.py): collections counted by generation, long
ones logged, the engine's startup heap frozen while it runs and given back at shutdown."""

from __future__ import annotations

import gc
import logging

from radixlm import Engine
from radixlm.core.runtime import gc_heap


def test_collections_counted_by_generation_and_long_ones_logged(caplog):
    pauses = gc_heap.watch(100.0)
    full = pauses.collections[2]
    gc.collect()
    assert pauses.collections[2] == full + 1
    assert pauses.seconds[2] > 0
    try:
        gc_heap.watch(1e-6)  # every collection is "long"
        with caplog.at_level(logging.WARNING, logger="radixlm"):
            gc.collect()
        assert any("garbage collection (generation 2" in r.getMessage() for r in caplog.records)
        caplog.clear()
        gc_heap.watch(0.0)  # 0: no warnings
        with caplog.at_level(logging.WARNING, logger="radixlm"):
            gc.collect()
        assert not any("garbage collection" in r.getMessage() for r in caplog.records)
    finally:
        gc_heap.watch(100.0)
    assert gc_heap.watch(100.0) is pauses  # one callback per process
    assert gc.callbacks.count(pauses) == 1


def test_engine_freezes_its_startup_heap_until_shutdown(llama_ckpt):
    engine = Engine(llama_ckpt, grammar_prepare_at_start=False)
    runner = engine._runner
    try:
        assert gc.get_freeze_count() > 0
        frozen = {id(o) for o in gc.get_objects()}  # the tracked objects the collector still traverses
        assert id(runner) not in frozen and id(runner.model) not in frozen
        stats = engine.get_stats()["gc"]
        assert stats["frozen_objects"] > 0 and stats["collections_total"][2] >= 1
        engine.generate("hello", {"max_new_tokens": 2, "temperature": 0})
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0
    assert id(runner) in {id(o) for o in gc.get_objects()}


def test_engine_without_freezing(llama_ckpt):
    before = gc.get_freeze_count()
    with Engine(llama_ckpt, gc_freeze=False, grammar_prepare_at_start=False) as engine:
        engine.generate("hello", {"max_new_tokens": 2, "temperature": 0})
        assert gc.get_freeze_count() == before
