"""Deliveries read from target records: which records are kdelay's, ids, and lateness sums."""

from __future__ import annotations

from confluent_kafka import TIMESTAMP_CREATE_TIME, Message

from kdelay.view.deliveries import (
    EDGES_MS,
    Delivery,
    bin_of,
    decode,
    lateness,
    named,
    percentile,
)

REQUESTS = "kdelay.requests"


def _target_record(offset: int, delivered_ms: int, due_ms: int | None,
                   origin: str | None = f"{REQUESTS}/1/40") -> Message:
    headers: list[tuple[str, str | bytes | None]] = [("trace-id", b"t-1")]
    if origin is not None:
        headers.append(("kdelay-origin", origin.encode()))
    if due_ms is not None:
        headers.append(("kdelay-due-ms", str(due_ms).encode()))
    return Message(topic="orders", partition=2, offset=offset, key=b"k", value=b"v",
                   headers=headers, timestamp=(TIMESTAMP_CREATE_TIME, delivered_ms))


def test_a_delivered_record_says_where_when_and_how_late() -> None:
    found = decode(_target_record(7, 1_250, 1_000), REQUESTS)
    assert found == Delivery("orders", 2, 7, 1_250, 1_000, f"{REQUESTS}/1/40")
    assert found is not None
    assert (found.lateness_ms, found.request(REQUESTS)) == (250, (1, 40))
    assert found.request("other.requests") is None


def test_records_kdelay_did_not_deliver_from_these_requests_are_skipped() -> None:
    assert decode(_target_record(1, 5, None), REQUESTS) is None, "no due time"
    assert decode(_target_record(1, 5, 1, origin=None), REQUESTS) is None, "no origin"
    assert decode(_target_record(1, 5, 1, origin="other/0/1"), REQUESTS) is None
    assert decode(_target_record(1, 5, 1, origin=f"{REQUESTS}x/0/1"), REQUESTS) is None


def test_ids_and_lanes_come_from_the_requests_still_held() -> None:
    first = Delivery("orders", 0, 1, 10, 5, f"{REQUESTS}/1/40")
    gone = Delivery("orders", 0, 2, 11, 5, f"{REQUESTS}/1/41")
    request = Message(topic=REQUESTS, partition=1, offset=40, headers=[
        ("kdelay-target", b"orders"), ("kdelay-id", b"order-42"), ("kdelay-lane", b"dev1")])
    shown = named([first, gone], REQUESTS, {(1, 40): request})
    assert [(d.schedule_id, d.lane) for d in shown] == [("order-42", "dev1"), (None, None)]


def test_percentiles_are_by_nearest_rank() -> None:
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50, 99, 100)
    assert percentile([7], 99) == 7


def test_bins_take_their_lower_edge_and_early_is_apart() -> None:
    assert bin_of(-1) == -1
    assert [bin_of(ms) for ms in (0, 9, 10, 999, 1_000, 10**9)] == [
        0, 0, 1, EDGES_MS.index(500), EDGES_MS.index(1_000), len(EDGES_MS) - 1]


def test_lateness_is_summed_per_target_with_early_ones_counted() -> None:
    deliveries = [Delivery("orders", 0, n, 1_000 + late, 1_000, f"{REQUESTS}/0/{n}")
                  for n, late in enumerate([5, 20, 20, 400, 3_000])]
    deliveries.append(Delivery("mail", 0, 9, 990, 1_000, f"{REQUESTS}/0/9"))
    mail, orders = lateness(deliveries)
    assert (mail.target, mail.count, mail.early, sum(mail.bins)) == ("mail", 1, 1, 0)
    assert (orders.count, orders.early, orders.p50_ms, orders.p99_ms, orders.max_ms) == (
        5, 0, 20, 3_000, 3_000)
    assert orders.bins[EDGES_MS.index(10)] == 2
    assert sum(orders.bins) == 5


def test_lateness_by_hour_sums_each_target_and_hour_newest_first() -> None:
    hour = 3_600_000
    deliveries = [Delivery("orders", 0, n, at + 10 * n, at, f"{REQUESTS}/0/{n}")
                  for n, at in enumerate([5 * hour, 5 * hour + 1, 6 * hour + 7])]
    deliveries.append(Delivery("mail", 0, 9, 6 * hour + 50, 6 * hour, f"{REQUESTS}/0/9"))
    rows = lateness(deliveries, by_hour=True)
    assert [(r.hour_ms, r.target, r.count, r.max_ms) for r in rows] == [
        (6 * hour, "mail", 1, 50), (6 * hour, "orders", 1, 20), (5 * hour, "orders", 2, 10)]
    assert all(r.hour_ms is None for r in lateness(deliveries))
