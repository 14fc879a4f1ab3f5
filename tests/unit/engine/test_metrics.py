"""BatchHistogram exposes what prometheus_client's Histogram exposes for the same values."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kdelay.engine.metrics import LATENESS_BUCKETS, BatchHistogram

NAME = "kdelay_lateness_seconds"
HELP = "Produce time minus due time, by the service clock"


def _exposed(registry: CollectorRegistry) -> tuple[list[str], float]:
    """The bucket and count lines, and the sum (summed in another order: not bit-equal)."""
    lines = [line for line in generate_latest(registry).decode().splitlines()
             if line.startswith(NAME) and not line.startswith(f"{NAME}_created")]
    sums = [float(line.split()[-1]) for line in lines if line.startswith(f"{NAME}_sum ")]
    assert len(sums) == 1
    return [line for line in lines if not line.startswith(f"{NAME}_sum ")], sums[0]


@pytest.mark.parametrize("values_ms", [
    [],
    [0, 1, 2, 3, 5, 10, 25, 26, 999, 1000, 1001],
    [-4, 60_000, 60_001, 3_600_000],
])
def test_batch_matches_histogram_observed_one_by_one(values_ms: list[int]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram(NAME, HELP, LATENESS_BUCKETS, ours)
    reference = Histogram(NAME, HELP, buckets=LATENESS_BUCKETS, registry=theirs)
    batch.observe_ms(values_ms[:2])
    batch.observe_ms(values_ms[2:])
    for value in values_ms:
        reference.observe(value / 1000)
    (our_lines, our_sum), (their_lines, their_sum) = _exposed(ours), _exposed(theirs)
    assert our_lines == their_lines
    assert len(our_lines) == len(LATENESS_BUCKETS) + 2  # every bucket, +Inf and the count
    assert our_sum == pytest.approx(their_sum)


def test_the_name_is_registered() -> None:
    registry = CollectorRegistry(auto_describe=True)
    BatchHistogram(NAME, HELP, LATENESS_BUCKETS, registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram(NAME, HELP, registry=registry)
