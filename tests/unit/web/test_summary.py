"""The console's summary counts what the view's own functions count, from columns.

Pure logic: entries are built as due keys and routes, as a partition's index
holds them (in due order), and every figure is checked against a plain count
of the same entries.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from kdelay.protocol import codec
from kdelay.protocol.controls import Scope, Subject
from kdelay.view.backlog import HeldBack
from kdelay.view.listing import BURST_MIN, SCAN_DEPTH, Filter, Order
from kdelay.web import summary as summary_module
from kdelay.web.summary import Builder, Summary, decoded_keys, runs

NOW = 1_800_000_000_000
Entry = tuple[int, int, int, str, str | None]  # due, request partition, offset, target, lane


def _entries(count: int, seed: int = 7) -> dict[int, list[Entry]]:
    """``count`` entries over two index partitions, with a same-second burst."""
    rng = random.Random(seed)
    targets = [("orders", None), ("orders", "dev1"), ("mail", None), ("(expired)", None)]
    found: dict[int, list[Entry]] = {0: [], 1: []}
    for offset in range(count):
        index = offset % 2
        due = NOW + rng.randrange(-3_600_000, 2 * 86_400_000)
        if offset % 5 == 0:
            due = NOW + 7_200_500  # one second that holds a burst
        target, lane = targets[rng.randrange(len(targets))]
        partition = index if offset % 11 else 1 - index  # some forwarded to the other index
        found[index].append((due, partition, offset, target, lane))
    return {index: sorted(rows) for index, rows in found.items()}


def _summary(entries: dict[int, list[Entry]], chunk: int = 97) -> Summary:
    builder = Builder()
    by_index = {}
    for index, rows in entries.items():
        chunks = [([codec.encode_due_key(d, p, o) for d, p, o, _, _ in rows[i:i + chunk]],
                   [(t, lane) for _, _, _, t, lane in rows[i:i + chunk]])
                  for i in range(0, len(rows), chunk)]
        by_index[index] = builder.columns(chunks)
    return Summary(NOW, builder.routes, by_index)


def _all(entries: dict[int, list[Entry]]) -> list[Entry]:
    return sorted(row for rows in entries.values() for row in rows)


def test_the_columns_hold_every_key_in_due_order() -> None:
    entries = _entries(1_000)
    summary = _summary(entries)
    for index, rows in entries.items():
        assert decoded_keys(summary.by_index[index]) == [
            codec.encode_due_key(d, p, o) for d, p, o, _, _ in rows]
    assert summary.total == 1_000
    assert summary.nbytes == 1_000 * 12  # second, ms, offset: 4+2+4; partition, route: 1+1


@pytest.fixture(params=[None, 7], ids=["one-slice", "slices-of-7"])
def span(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Screens count a slice of entries at a time: the same figures whatever the slice."""
    if request.param is not None:
        monkeypatch.setattr(summary_module, "SPAN", request.param)


@pytest.mark.usefixtures("span")
def test_the_backlog_counts_as_a_plain_count_does() -> None:
    entries = _entries(2_000)
    rows = _all(entries)
    found = _summary(entries).backlog(NOW, 3_600_000)
    assert found.pending == len(rows)
    assert found.overdue == sum(1 for d, *_ in rows if d <= NOW)
    assert found.earliest_due_ms == rows[0][0]
    assert found.latest_due_ms == rows[-1][0]
    assert dict(found.buckets) == Counter(d // 3_600_000 * 3_600_000 for d, *_ in rows)
    assert found.by_partition == dict(sorted(Counter(p for _, p, *_ in rows).items()))
    assert found.by_target == dict(Counter(t for *_, t, _ in rows))


def test_lanes_are_counted_with_none_named() -> None:
    entries = _entries(500)
    assert _summary(entries).lanes() == dict(
        Counter(lane or "(none)" for *_, lane in _all(entries)))


@pytest.mark.usefixtures("span")
@pytest.mark.parametrize("chosen", [
    Filter(), Filter(target="orders"), Filter(lane="dev1"),
    Filter(target="mail", due_from_ms=NOW, due_to_ms=NOW + 86_400_000),
    Filter(target="nobody")])
def test_the_timeline_counts_each_target_by_bucket(chosen: Filter) -> None:
    entries = _entries(3_000)
    kept = [row for row in _all(entries) if chosen.passes(row[3], row[4])
            and (chosen.due_from_ms is None or row[0] >= chosen.due_from_ms)
            and (chosen.due_to_ms is None or row[0] <= chosen.due_to_ms)]
    found = _summary(entries).timeline(60_000, chosen)
    expected: dict[str, Counter[int]] = {}
    for due, _, _, target, _ in kept:
        expected.setdefault(target, Counter())[due // 60_000 * 60_000] += 1
    assert found.total == len(kept)
    assert found.by_target == {t: dict(sorted(c.items())) for t, c in sorted(expected.items())}
    seconds = Counter(due // 1_000 * 1_000 for due, *_ in kept)
    bursts = {s // 60_000 * 60_000: (s, n) for s, n in seconds.items() if n >= BURST_MIN}
    assert found.bursts == bursts


@pytest.mark.usefixtures("span")
def test_a_page_is_the_filtered_entries_in_delivery_order_with_the_true_total() -> None:
    entries = _entries(2_000)
    chosen = Filter(target="orders", due_from_ms=NOW)
    kept = [row for row in _all(entries) if row[3] == "orders" and row[0] >= NOW]
    total, page = _summary(entries).page(chosen, skip=30, limit=25)
    assert total == len(kept)
    assert [key for _, key in page] == [codec.encode_due_key(d, p, o)
                                        for d, p, o, _, _ in kept[30:55]]
    held = {codec.encode_due_key(d, p, o): index
            for index, rows in entries.items() for d, p, o, _, _ in rows}
    assert all(held[key] == index for index, key in page)


def _plain(row: Entry, sort: str) -> tuple[object, ...]:
    """The order a plain sort of the entries gives: by due, target or request."""
    due, partition, offset, target, lane = row
    if sort == "target":
        return target, lane or "", due, partition, offset
    if sort == "request":
        return partition, offset, due
    return due, partition, offset


@pytest.fixture(params=[None, 5], ids=["one-rank-slice", "rank-slices-of-5"])
def rank_span(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sort other than by due ranks a slice at a time: the same page whatever the slice."""
    if request.param is not None:
        monkeypatch.setattr(summary_module, "RANK_SPAN", request.param)


@pytest.mark.usefixtures("span", "rank_span")
@pytest.mark.parametrize("sort", ["due", "target", "request"])
@pytest.mark.parametrize("descending", [False, True], ids=["asc", "desc"])
@pytest.mark.parametrize("chosen", [Filter(), Filter(target="orders", due_from_ms=NOW),
                                    Filter(due_to_ms=NOW + 86_400_000)],
                         ids=["all", "target-and-from", "until"])
def test_each_sort_pages_as_a_plain_sort_does(sort: str, descending: bool,
                                              chosen: Filter) -> None:
    entries = _entries(600)
    kept = sorted((row for row in _all(entries)
                   if chosen.passes(row[3], row[4])
                   and (chosen.due_from_ms is None or row[0] >= chosen.due_from_ms)
                   and (chosen.due_to_ms is None or row[0] <= chosen.due_to_ms)),
                  key=lambda row: _plain(row, sort), reverse=descending)
    summary = _summary(entries)
    for skip, limit in ((0, 25), (37, 40), (len(kept) - 3, 10)):
        total, page = summary.page(chosen, skip, limit, Order(sort, descending))
        assert total == len(kept)
        assert [key for _, key in page] == [codec.encode_due_key(d, p, o)
                                            for d, p, o, _, _ in kept[skip:skip + limit]]


def test_a_ranked_sort_reaches_the_first_pages_only_and_ids_are_not_in_the_summary() -> None:
    summary = _summary(_entries(10))
    with pytest.raises(ValueError, match="first"):
        summary.page(Filter(), SCAN_DEPTH, 1, Order("target"))
    with pytest.raises(ValueError, match="cannot sort by id"):
        summary.page(Filter(), 0, 10, Order("id"))


def test_an_id_prefix_is_not_counted_from_the_summary() -> None:
    with pytest.raises(ValueError, match="id prefix"):
        _summary(_entries(10)).page(Filter(id_prefix="order-"), 0, 10)


def test_an_empty_summary_counts_nothing() -> None:
    summary = _summary({0: [], 1: []})
    assert summary.backlog(NOW, 60_000).pending == 0
    assert summary.timeline(60_000).total == 0
    assert summary.page(Filter(), 0, 10) == (0, [])


def test_runs_count_equal_neighbours() -> None:
    import numpy as np
    values = np.array([1, 1, 2, 5, 5, 5], dtype=np.int64)
    assert runs(values) == {1: 2, 2: 1, 5: 3}
    assert runs(values[:0]) == {}


@pytest.mark.usefixtures("span")
def test_held_back_counts_the_due_entries_of_each_controlled_target_and_lane() -> None:
    entries = _entries(2_000)
    orders, dev1 = Subject(Scope.TARGET, "orders"), Subject(Scope.LANE, "dev1")
    held = _summary(entries).held_back(NOW, [orders, dev1, Subject(Scope.TARGET, "none")])
    due = [row for row in _all(entries) if row[0] <= NOW]
    for subject, mine in ((orders, [r for r in due if r[3] == "orders"]),
                          (dev1, [r for r in due if r[4] == "dev1"])):
        assert held[subject] == HeldBack(len(mine), min(r[0] for r in mine))
    assert held[Subject(Scope.TARGET, "none")] == HeldBack()


@pytest.mark.usefixtures("span")
def test_a_burst_split_unevenly_over_partitions_is_counted_whole() -> None:
    """95 + 10 entries in one second over two partitions are a burst (105); 60 + 30 are
    not; the first pass keeps only seconds with half the burst in one partition."""
    second, other = NOW + 5_000, NOW + 9_000
    entries: dict[int, list[Entry]] = {
        0: sorted([(second + n % 1_000, 0, n, "orders", None) for n in range(95)]
                  + [(other, 0, 1_000 + n, "orders", None) for n in range(60)]),
        1: sorted([(second + 999, 1, n, "orders", None) for n in range(10)]
                  + [(other + n, 1, 1_000 + n, "orders", None) for n in range(30)])}
    found = _summary(entries, chunk=13).timeline(60_000)
    assert found.bursts == {second // 60_000 * 60_000: (second, 105)}


@pytest.mark.usefixtures("span")
def test_wide_values_widen_their_columns_and_bounds_are_exact_to_the_ms() -> None:
    """Offsets past 2**32, partitions past 255 and dues far ahead keep their values; a due
    window cuts inside a second at the ms."""
    rows: list[Entry] = sorted([
        (NOW + 1, 300, 2**40 + 5, "orders", None), (NOW + 499, 2, 7, "mail", None),
        (NOW + 500, 2, 8, "mail", None), (NOW + 999, 2, 9, "orders", None),
        (5_000_000_000_000_123, 1, 3, "orders", None)])
    entries = {0: rows}
    summary = _summary(entries, chunk=2)
    columns = summary.by_index[0]
    assert decoded_keys(columns) == [codec.encode_due_key(d, p, o) for d, p, o, _, _ in rows]
    assert columns.offset.dtype == np.uint64
    assert columns.partition.dtype == np.uint16
    assert columns.due_s.dtype == np.uint64
    chosen = Filter(due_from_ms=NOW + 499, due_to_ms=NOW + 500)
    total, page = summary.page(chosen, 0, 10)
    assert total == 2
    assert [key for _, key in page] == [codec.encode_due_key(NOW + 499, 2, 7),
                                        codec.encode_due_key(NOW + 500, 2, 8)]
    assert summary.backlog(NOW + 499, 60_000).overdue == 2


@pytest.mark.usefixtures("span", "rank_span")
def test_columns_whose_entries_are_all_alike_hold_one_value_and_count_the_same() -> None:
    """No forwarded schedule and one target: the partition and route columns take one
    value, not a byte an entry, and every screen counts as a plain count does."""
    rng = random.Random(3)
    entries: dict[int, list[Entry]] = {
        index: sorted((NOW + rng.randrange(-3_600_000, 86_400_000), index, offset, "orders",
                       None) for offset in range(500))
        for index in (0, 1)}
    rows = _all(entries)
    summary = _summary(entries)
    assert summary.nbytes == 1_000 * 10 + 2 * 2  # second, ms, offset; one value twice
    for index, columns in summary.by_index.items():
        assert decoded_keys(columns) == [codec.encode_due_key(d, p, o)
                                         for d, p, o, _, _ in entries[index]]
    found = summary.backlog(NOW, 3_600_000)
    assert (found.pending, found.by_partition, found.by_target) == (
        1_000, {0: 500, 1: 500}, {"orders": 1_000})
    assert summary.timeline(3_600_000, Filter(target="orders")).by_target == {"orders": dict(
        sorted(Counter(d // 3_600_000 * 3_600_000 for d, *_ in rows).items()))}
    for sort in ("due", "target", "request"):
        kept = sorted(rows, key=lambda row, s=sort: _plain(row, s))  # type: ignore[misc]
        total, page = summary.page(Filter(target="orders"), 10, 20, Order(sort))
        assert total == 1_000
        assert [key for _, key in page] == [codec.encode_due_key(d, p, o)
                                            for d, p, o, _, _ in kept[10:30]]
