"""The service's garbage-collector policy (``kdelay.engine.runner.tune_gc``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kdelay.engine.runner import GC_THRESHOLDS, tune_gc


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

