"""BatchHistogram exposes what prometheus_client's Histogram exposes for the same values."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kdelay.engine.metrics import LATENESS_BUCKETS, BatchHistogram, Metrics
from kdelay.protocol import envelope
from kdelay.protocol.envelope import ErrorCode

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
    # unsorted, repeated, and on, below and above every bound
    [v for bound in reversed(LATENESS_BUCKETS) for v in (round(bound * 1000) + d
                                                          for d in (1, 0, -1, 0))],
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


def test_each_label_set_matches_a_labelled_histogram() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram(NAME, HELP, LATENESS_BUCKETS, ours, ("target",))
    reference = Histogram(NAME, HELP, ["target"], buckets=LATENESS_BUCKETS, registry=theirs)
    for target, values_ms in (("orders", [0, 5, 1_000]), ("mail", [70_000]),
                              ("orders", [3])):
        batch.observe_ms(values_ms, target)
        for value in values_ms:
            reference.labels(target=target).observe(value / 1000)
    assert sorted(_lines(ours)) == sorted(_lines(theirs))
    with pytest.raises(ValueError, match="takes labels"):
        batch.observe_ms([1])


def _lines(registry: CollectorRegistry) -> list[str]:
    """Bucket and count lines (sums are summed in another order: not bit-equal)."""
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith(NAME) and "_created" not in line and "_sum" not in line]


def test_the_name_is_registered() -> None:
    registry = CollectorRegistry(auto_describe=True)
    BatchHistogram(NAME, HELP, LATENESS_BUCKETS, registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram(NAME, HELP, registry=registry)


def test_lane_refusals_are_counted_by_a_bounded_lane_label() -> None:
    metrics = Metrics()

    def refused(code: str, lane: bytes | None) -> list[tuple[str, str | bytes | None]]:
        named = [] if lane is None else [(envelope.LANE, lane)]
        return [("trace", b"1"), *named, (envelope.ERROR, b"forged"),
                *envelope.rejection_headers(envelope.Rejection(ErrorCode(code), "why"))]

    metrics.intake.count_lane_refusals([
        refused("wrong-lane", b"dev1"), refused("wrong-lane", b"dev1"),
        refused("missing-lane", None), *(refused("unknown-lane", f"x{n}".encode())
                                         for n in range(50)),
        refused("bad-time", b"dev1"), None], {"dev1", "dev2"})  # None: a record without headers
    counted = {(s.labels["lane"], s.labels["reason"]): s.value
               for family in metrics.intake.lane_refused.collect() for s in family.samples
               if s.name.endswith("_total")}
    assert counted == {("dev1", "wrong-lane"): 2, ("(none)", "missing-lane"): 1,
                       ("(unknown)", "unknown-lane"): 50}
