"""``kdelay stats``: a terminal summary of running instances, read from their metrics.

Each instance's ``/metrics`` endpoint is read twice, ``interval_s`` apart (or
on every refresh with ``--watch``); rates and the lateness percentiles come
from the difference between two readings, the gauges from the latest one.
Lateness percentiles are estimated from the histogram buckets the way
Prometheus's ``histogram_quantile`` does (linear within a bucket), so they are
as coarse as the buckets.

An endpoint that cannot be read is shown as down with the reason; nothing
raises for it.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

READ_TIMEOUT_S = 5.0
Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Scrape:
    """The samples of one endpoint at one moment (``taken_s``, monotonic seconds)."""

    url: str
    taken_s: float
    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)
    error: str | None = None

    def total(self, name: str, **labels: str) -> float | None:
        """The sum of the samples named ``name`` whose labels include ``labels``."""
        found = [v for lbls, v in self.samples.get(name, ()) if set(labels.items()) <= lbls]
        return sum(found) if found else None

    def peak(self, name: str) -> float | None:
        """The largest sample named ``name``, or None."""
        found = [v for _, v in self.samples.get(name, ())]
        return max(found) if found else None

    def by(self, name: str, label: str) -> dict[str, float]:
        """The samples named ``name`` summed by the value of ``label``."""
        out: dict[str, float] = defaultdict(float)
        for lbls, value in self.samples.get(name, ()):
            out[dict(lbls).get(label, "")] += value
        return dict(out)


def parse(url: str, text: str, taken_s: float) -> Scrape:
    """Parse a Prometheus text exposition into a :class:`Scrape`.

    Raises ValueError when ``text`` is not in the text format.
    """
    samples: dict[str, list[tuple[Labels, float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((frozenset(sample.labels.items()), float(sample.value)))
    return Scrape(url, taken_s, dict(samples))


def read(url: str, clock: Callable[[], float] = time.monotonic) -> Scrape:
    """Read one metrics endpoint; a failure gives a Scrape with ``error`` set."""
    taken = clock()
    try:
        with urllib.request.urlopen(url, timeout=READ_TIMEOUT_S) as response:  # noqa: S310
            text = response.read().decode("utf-8")
        return parse(url, text, taken)
    except (OSError, ValueError) as exc:
        return Scrape(url, taken, error=str(exc))


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Estimate the ``q`` quantile from cumulative ``(upper bound, count)`` buckets.

    As Prometheus's ``histogram_quantile``: linear interpolation inside the
    bucket the rank falls in, the lowest bucket starting at 0, and the highest
    finite bound when the rank falls in the ``+Inf`` bucket. None without
    observations.
    """
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return ordered[-1][0]


@dataclass(frozen=True)
class Summary:
    """What ``kdelay stats`` shows of one instance. Rates are per second."""

    url: str
    error: str | None = None
    owned_partitions: float | None = None
    request_partitions: float | None = None
    intake_rate: float | None = None
    delivered_rate: float | None = None
    dead_letter_rate: float | None = None
    dead_letters_by_reason: dict[str, float] = field(default_factory=dict)
    dead_letters_total_by_reason: dict[str, float] = field(default_factory=dict)
    lateness_p50_s: float | None = None
    lateness_p99_s: float | None = None
    pending: float | None = None
    overdue: float | None = None
    oldest_overdue_s: float | None = None
    intake_lag: float | None = None
    clock_skew_s: float | None = None
    restoring: float | None = None
    # Changelog offsets the running restores still replay, of how many in all, at what pace.
    restore_remaining: float | None = None
    restore_total: float | None = None
    restore_rate: float | None = None
    # RocksDB's memory (block cache, memtables, table readers) and its budgets, in bytes.
    rocksdb_bytes: float | None = None
    rocksdb_budget_bytes: float | None = None


def _rate(before: Scrape | None, after: Scrape, name: str) -> float | None:
    now = after.total(name)
    if before is None or now is None or after.taken_s <= before.taken_s:
        return None
    return max(0.0, now - (before.total(name) or 0.0)) / (after.taken_s - before.taken_s)


def _buckets(reading: Scrape, name: str) -> dict[float, float]:
    out: dict[float, float] = defaultdict(float)
    for lbls, value in reading.samples.get(name, ()):
        out[float(dict(lbls)["le"])] += value
    return out


def _lateness(before: Scrape | None, after: Scrape, q: float) -> float | None:
    """The lateness quantile over the interval; over the whole run without ``before``."""
    now = _buckets(after, "kdelay_lateness_seconds_bucket")
    then = _buckets(before, "kdelay_lateness_seconds_bucket") if before else {}
    return quantile(q, [(le, count - then.get(le, 0.0)) for le, count in now.items()])


def summarize(before: Scrape | None, after: Scrape) -> Summary:
    """Summarise an instance from two readings of it (``before`` may be None: no rates)."""
    if after.error is not None:
        return Summary(after.url, error=after.error)
    if before is not None and before.error is not None:
        before = None
    span = after.taken_s - before.taken_s if before is not None else 0.0
    totals = after.by("kdelay_dead_lettered_records_total", "reason")
    reasons: dict[str, float] = {}
    if before is not None and span > 0:
        earlier = before.by("kdelay_dead_lettered_records_total", "reason")
        reasons = {r: max(0.0, n - earlier.get(r, 0.0)) / span for r, n in totals.items()}
    return Summary(
        url=after.url,
        owned_partitions=after.total("kdelay_owned_partitions"),
        request_partitions=after.peak("kdelay_request_partitions"),
        intake_rate=_rate(before, after, "kdelay_intake_records_total"),
        delivered_rate=_rate(before, after, "kdelay_delivered_records_total"),
        dead_letter_rate=_rate(before, after, "kdelay_dead_lettered_records_total"),
        dead_letters_by_reason=reasons,
        dead_letters_total_by_reason=totals,
        lateness_p50_s=_lateness(before, after, 0.5),
        lateness_p99_s=_lateness(before, after, 0.99),
        pending=after.total("kdelay_pending_entries"),
        overdue=after.total("kdelay_overdue_entries"),
        oldest_overdue_s=after.peak("kdelay_overdue_oldest_age_seconds"),
        intake_lag=after.total("kdelay_intake_lag_records"),
        clock_skew_s=after.total("kdelay_clock_skew_seconds"),
        restoring=after.total("kdelay_restoring_partitions"),
        restore_remaining=after.total("kdelay_restore_remaining_records"),
        restore_total=after.total("kdelay_restore_total_records"),
        restore_rate=_rate(before, after, "kdelay_restored_changelog_records_total"),
        rocksdb_bytes=_rocksdb(after),
        rocksdb_budget_bytes=after.total("kdelay_rocksdb_memory_budget_bytes"),
    )


def _rocksdb(reading: Scrape) -> float | None:
    """RocksDB's memory from its parts (``pinned`` is part of ``block_cache``)."""
    parts = reading.by("kdelay_rocksdb_memory_bytes", "part")
    if not parts:
        return None
    return sum(value for part, value in parts.items() if part != "pinned")


def to_json(summaries: Iterable[Summary]) -> list[dict[str, object]]:
    """The summaries as plain JSON-ready dicts (``--json``)."""
    return [asdict(s) for s in summaries]


def _num(value: float | None, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) < 1:
        return f"{value * 1000:.1f}ms"
    return f"{value:.2f}s"


def _short(url: str) -> str:
    """``http://host:port/metrics`` as ``host:port``; any other URL as it is."""
    rest = url.removeprefix("http://")
    return rest.removesuffix("/metrics") if "/" not in rest.removesuffix("/metrics") else url


def render(summaries: Sequence[Summary]) -> Group:
    """Build the terminal view: one row per instance, then dead letters by reason."""
    table = Table(title="kdelay instances", title_justify="left")
    for column in ("instance", "owned", "intake/s", "delivered/s", "dlq/s", "late p50",
                   "late p99", "pending", "overdue", "oldest overdue", "intake lag",
                   "clock skew"):
        table.add_column(column, justify="left" if column == "instance" else "right")
    state = Table(title="local state", title_justify="left")
    for column in ("instance", "restoring", "restore left", "restore/s", "rocksdb memory",
                   "rocksdb budget"):
        state.add_column(column, justify="left" if column == "instance" else "right")
    reasons = Table(title="dead letters by reason", title_justify="left")
    for column in ("instance", "reason", "total", "/s"):
        reasons.add_column(column, justify="right" if column in ("total", "/s") else "left")
    down: list[str] = []
    for s in summaries:
        if s.error is not None:
            table.add_row(_short(s.url), "[red]down[/red]")
            down.append(f"{_short(s.url)}: {s.error}")
            continue
        owned = f"{_num(s.owned_partitions)}/{_num(s.request_partitions)}"
        table.add_row(_short(s.url), owned, _num(s.intake_rate, digits=1),
                      _num(s.delivered_rate, digits=1), _num(s.dead_letter_rate, digits=2),
                      _seconds(s.lateness_p50_s), _seconds(s.lateness_p99_s), _num(s.pending),
                      _num(s.overdue), _seconds(s.oldest_overdue_s), _num(s.intake_lag),
                      _seconds(s.clock_skew_s))
        left = (f"{_num(s.restore_remaining)}/{_num(s.restore_total)}"
                if s.restore_total else "-")
        state.add_row(_short(s.url), _num(s.restoring), left, _num(s.restore_rate),
                      _num(_mb(s.rocksdb_bytes), " MB"), _num(_mb(s.rocksdb_budget_bytes), " MB"))
        for reason, total in sorted(s.dead_letters_total_by_reason.items()):
            reasons.add_row(_short(s.url), reason, _num(total),
                            _num(s.dead_letters_by_reason.get(reason), digits=2))
    return Group(table, state, reasons,
                 *(Text(f"down: {line}", style="red") for line in down))


def _mb(value: float | None) -> float | None:
    return None if value is None else value / (1 << 20)


class Stats:
    """Reads a set of endpoints and keeps the previous reading of each, for rates."""

    def __init__(self, urls: Sequence[str],
                 reader: Callable[[str], Scrape] = read) -> None:
        self._urls = list(urls)
        self._read = reader
        self._last: dict[str, Scrape] = {}

    def refresh(self) -> list[Summary]:
        """Read every endpoint once; summarise each against its previous reading."""
        out = []
        for url in self._urls:
            now = self._read(url)
            out.append(summarize(self._last.get(url), now))
            self._last[url] = now
        return out


def endpoints(urls: Sequence[str], metrics_port: int | None) -> list[str]:
    """The metrics URLs to read: ``urls`` completed, else this host's ``--metrics-port``.

    ``host:port`` becomes ``http://host:port/metrics``. Raises ValueError when
    neither is given.
    """
    if not urls:
        if metrics_port is None:
            raise ValueError("give --url (repeatable) or --metrics-port")
        urls = [f"127.0.0.1:{metrics_port}"]
    out = []
    for url in urls:
        full = url if "://" in url else f"http://{url}"
        if full.split("://", 1)[1].count("/") == 0:
            full += "/metrics"
        out.append(full)
    return out


def show(urls: Sequence[str], *, console: Console, watch: bool = False, as_json: bool = False,
         interval_s: float = 2.0, sleep: Callable[[float], None] = time.sleep,
         stats: Stats | None = None) -> int:
    """Print a summary of the instances at ``urls``; with ``watch``, refresh until Ctrl-C.

    Rates need two readings, so the first summary comes ``interval_s`` after
    the start. With ``as_json`` each summary is one JSON line. Returns the exit
    status: 1 when no instance could be read, else 0.
    """
    stats = stats or Stats(urls)
    stats.refresh()
    try:
        sleep(interval_s)
        summaries = stats.refresh()
        if not watch:
            _print(console, summaries, as_json)
            return 0 if any(s.error is None for s in summaries) else 1
        if as_json:
            while True:
                _print(console, summaries, as_json)
                sleep(interval_s)
                summaries = stats.refresh()
        with Live(render(summaries), console=console, auto_refresh=False) as live:
            while True:
                sleep(interval_s)
                live.update(render(stats.refresh()), refresh=True)
    except KeyboardInterrupt:
        return 0


def _print(console: Console, summaries: list[Summary], as_json: bool) -> None:
    if as_json:
        console.out(json.dumps(to_json(summaries)), highlight=False)
    else:
        console.print(render(summaries))
