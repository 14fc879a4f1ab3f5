"""The service's garbage-collector policy (``kdelay.engine.runner.tune_gc``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from confluent_kafka import Message

from kdelay.engine.delivery._readahead import MAX_HELD_BATCHES
from kdelay.engine.runner import GC_THRESHOLDS, tune_gc
from kdelay.plumbing.settings import Settings

PARTITIONS = 3
"""The partitions of the burst the policy is measured with (tools/bench's default)."""


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """Put the interpreter's collector back as it was after the test."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_gc")
def test_tune_gc_freezes_what_is_alive_and_raises_the_thresholds() -> None:
    alive_before: list[int] = []
    assert any(o is alive_before for o in gc.get_objects())
    tune_gc()
    assert gc.get_threshold() == GC_THRESHOLDS
    assert gc.get_freeze_count() > 0
    assert not any(o is alive_before for o in gc.get_objects())



@pytest.mark.usefixtures("restored_gc")
def test_the_originals_delivery_holds_are_not_walked_by_the_collector() -> None:
    """Delivery holds at most MAX_HELD_BATCHES batches of originals a partition, each a
    message with its list of headers: with the default batch size, a burst over three
    partitions holds them all without a collection of the youngest generation."""
    tune_gc()
    started: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    held = MAX_HELD_BATCHES * Settings().batch_size * PARTITIONS
    gc.callbacks.append(count)
    try:
        originals = [Message(topic="requests", partition=0, offset=at, value=b"v",
                             headers=[("kdelay-target", b"target")]) for at in range(held)]
        assert all(isinstance(original.headers(), list) for original in originals)
    finally:
        gc.callbacks.remove(count)
    assert started == []
