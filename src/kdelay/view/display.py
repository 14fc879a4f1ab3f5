"""How the operator commands print: rich tables for people, JSON for programs.

Every function here turns a result of :mod:`kdelay.view.pending` or
:mod:`kdelay.view.retention` into text or a rich renderable; none talks to Kafka.
Times are shown in UTC and relative to the command's "now" ("in 12 s",
"late 3 s"); JSON carries integer milliseconds since the epoch.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict

import orjson
from confluent_kafka import Message
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kdelay.recurring import Description
from kdelay.view.backlog import Backlog
from kdelay.view.lookup import Lookup
from kdelay.view.pending import Original, Pending, headers_of
from kdelay.view.retention import PartitionRetention, RetentionReport

Held = Callable[[str | None, str | None], str | None]
"""What holds a record to a target (of a lane) back: a sentence naming the target control,
or None (see :func:`kdelay.controls.holding`)."""


def _not_held(target: str | None, lane: str | None) -> str | None:
    return None


_NOT_HELD: Held = _not_held
PREVIEW_CHARS = 40
VALUE_PREVIEW_CHARS = 200
BAR_WIDTH = 40
TABLE_BUCKETS = 48
_UNITS = ((86_400_000, "d"), (3_600_000, "h"), (60_000, "min"), (1_000, "s"))


def utc(ms: int | None) -> str:
    """``2026-11-23 03:12:45.123Z`` for epoch ms; ``-`` for None."""
    if ms is None:
        return "-"
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{ms % 1000:03d}Z"


def utc_short(ms: int | None) -> str:
    """``11-23 03:12:45`` (UTC, to the second) for narrow tables; ``-`` for None."""
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%m-%d %H:%M:%S")


def span(ms: int) -> str:
    """A duration in the largest unit that keeps it at 2 or more: ``90 s``, ``3 h``, ``250 ms``."""
    for unit, name in _UNITS:
        if ms >= 2 * unit:
            return f"{ms / unit:.0f} {name}" if ms >= 10 * unit else f"{ms / unit:.1f} {name}"
    return f"{ms} ms"


def relative(due_ms: int, now_ms: int) -> str:
    """``in 12 s`` for a future due time, ``late 3 s`` for a past one, ``now`` for now."""
    delta = due_ms - now_ms
    if delta == 0:
        return "now"
    return f"in {span(delta)}" if delta > 0 else f"late {span(-delta)}"


def text_of(data: bytes | None) -> str | None:
    """``data`` as UTF-8 text, or None when it is null or not UTF-8."""
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def preview(data: bytes | None, chars: int = PREVIEW_CHARS) -> str:
    """A printable preview: the text when ``data`` is printable UTF-8, else hex; ``null``."""
    if data is None:
        return "null"
    text = text_of(data)
    shown = text if text is not None and text.isprintable() else "0x" + data.hex()
    return shown if len(shown) <= chars else shown[:chars - 1] + "…"


def due_json(listed: Sequence[tuple[Pending, Original]], topic: str,
             held: Held = _NOT_HELD) -> Iterator[str]:
    """One JSON object per listed entry (``kdelay due --json``); ``held_by`` says which
    target control holds it back, if any."""
    for entry, original in listed:
        yield orjson.dumps({
            "due_ms": entry.due_ms, "topic": topic, "partition": entry.partition,
            "offset": entry.offset, "id": entry.schedule_id, "target": original.target,
            "lane": original.lane, "key": text_of(original.key),
            "key_hex": None if original.key is None else original.key.hex(),
            "value_bytes": original.value_bytes, "record_ms": entry.record_ms,
            "original": original.state.value,
            "held_by": held(original.target, original.lane),
        }).decode()


def due_table(listed: Sequence[tuple[Pending, Original]], topic: str, now_ms: int,
              held: Held = _NOT_HELD) -> Table:
    """The ``kdelay due`` table, in due order; a ``held by`` column when a target control
    holds any listed entry back."""
    table = Table(title=f"due entries of {topic} ({len(listed)})", title_justify="left")
    laned = any(original.lane is not None for _, original in listed)
    notes = [held(original.target, original.lane) for _, original in listed]
    controlled = any(notes)
    names = ("due (UTC)", "when", "request", "id", "target", *(("lane",) if laned else ()),
             "key", "value bytes", *(("held by",) if controlled else ()))
    for name in names:
        table.add_column(name, justify="right" if name == "value bytes" else "left")
    for (entry, original), note in zip(listed, notes, strict=True):
        target = original.target or f"({original.state.value})"
        size = original.value_bytes
        lane = (original.lane or "-",) if laned else ()
        table.add_row(utc(entry.due_ms), relative(entry.due_ms, now_ms),
                      f"{topic}/{entry.partition}/{entry.offset}", entry.schedule_id or "-",
                      target, *lane, preview(original.key) if original.record else "-",
                      "-" if size is None else str(size), *((note or "-",) if controlled else ()))
    return table


def backlog_json(backlog: Backlog, controls: Sequence[str] = ()) -> str:
    """The ``kdelay backlog --json`` object; ``controls``: the target controls in force,
    one sentence each (their targets' pending records wait while paused)."""
    body: dict[str, object] = {
        "now_ms": backlog.now_ms, "pending": backlog.pending, "overdue": backlog.overdue,
        "earliest_due_ms": backlog.earliest_due_ms, "latest_due_ms": backlog.latest_due_ms,
        "bucket_ms": backlog.bucket_ms,
        "buckets": [{"start_ms": start, "count": count} for start, count in backlog.buckets],
        "by_partition": {str(p): n for p, n in backlog.by_partition.items()},
    }
    if backlog.by_target is not None:
        body["by_target"] = backlog.by_target
    if backlog.lane is not None:
        body["lane"] = backlog.lane
    body["controls"] = list(controls)
    return orjson.dumps(body).decode()


def _when(ms: int | None, now_ms: int) -> str:
    """A due time in UTC with its relative form: ``2026-... (in 3 h)``; ``-`` for None."""
    return "-" if ms is None else f"{utc(ms)} ({relative(ms, now_ms)})"


def _bar(count: int, most: int) -> str:
    return "█" * max(1, round(BAR_WIDTH * count / most)) if count else ""


def backlog_tables(backlog: Backlog, controls: Sequence[str] = ()) -> RenderableType:
    """The ``kdelay backlog`` summary (with the target controls in force, whose targets'
    records are held back), due-time histogram and per-partition/target counts."""
    now = backlog.now_ms
    of_lane = "" if backlog.lane is None else f" in lane {backlog.lane}"
    held = "".join(f"\nheld by a target control: {line}" for line in controls)
    summary = Text(
        f"pending{of_lane} {backlog.pending}, overdue (ready now) {backlog.overdue}\n"
        f"earliest due {_when(backlog.earliest_due_ms, now)}\n"
        f"latest due   {_when(backlog.latest_due_ms, now)}{held}")
    parts: list[RenderableType] = [summary, _buckets_table(backlog)]
    counts = backlog.by_target if backlog.by_target is not None else {
        str(p): n for p, n in backlog.by_partition.items()}
    what = "target" if backlog.by_target is not None else "partition"
    table = Table(title=f"by {what}", title_justify="left")
    table.add_column(what)
    table.add_column("pending", justify="right")
    for name, count in counts.items():
        table.add_row(name, str(count))
    parts.append(table)
    return Group(*parts)


def _buckets_table(backlog: Backlog) -> Table:
    """One row per non-empty bucket (the first :data:`TABLE_BUCKETS`), with a bar."""
    table = Table(title=f"due per {span(backlog.bucket_ms)} (UTC)", title_justify="left")
    table.add_column("from")
    table.add_column("count", justify="right")
    table.add_column("")
    most = max((count for _, count in backlog.buckets), default=0)
    for start, count in backlog.buckets[:TABLE_BUCKETS]:
        table.add_row(utc(start), str(count), _bar(count, most))
    hidden = len(backlog.buckets) - TABLE_BUCKETS
    if hidden > 0:
        rest = sum(count for _, count in backlog.buckets[TABLE_BUCKETS:])
        table.add_row(f"… {hidden} more buckets", str(rest), "")
    return table


def render_original(record: Message) -> RenderableType:
    """One original request record: coordinates, timestamp, every header, key and value.

    Headers are shown in full and in order (user headers and ``kdelay-*``
    alike); key and value as text when printable UTF-8, else as hex.
    """
    table = Table(title="original record", title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("coordinates", f"{record.topic()}/{record.partition()}/{record.offset()}")
    table.add_row("timestamp", utc(record.timestamp()[1]))
    for name, value in headers_of(record):
        table.add_row(f"header {name}", preview(value, chars=10_000))
    table.add_row("key", preview(record.key(), chars=VALUE_PREVIEW_CHARS))
    value = record.value()
    size = 0 if value is None else len(value)
    table.add_row(f"value ({size} bytes)", preview(value, chars=VALUE_PREVIEW_CHARS))
    return table


def show_renderable(found: Lookup, topic: str, now_ms: int,
                    held: Held = _NOT_HELD) -> RenderableType:
    """``kdelay show``: where the request stands (and the control that holds it back, if
    any), then its original record."""
    lines = [f"{found.reference}: {found.status}"]
    note = _held_note(found, held)
    if note is not None:
        lines.append(f"held by a target control: {note}")
    if found.coordinates is not None:
        lines.append(f"request {topic}/{found.coordinates[0]}/{found.coordinates[1]}")
    entry = found.pending
    if entry is not None:
        lines.append(f"due {utc(entry.due_ms)} ({relative(entry.due_ms, now_ms)})")
        lines.append(f"schedule id {entry.schedule_id or '-'}")
    original = found.original
    if original is not None and original.target is not None and entry is not None:
        lane = "" if original.lane is None else f" (lane {original.lane})"
        lines.append(f"goes to {original.target}{lane}")
    if found.series is not None:
        lines.extend(series_lines(found.series, now_ms))
    parts: list[RenderableType] = [Text("\n".join(lines))]
    if original is not None and original.record is not None:
        parts.append(render_original(original.record))
    elif original is not None:
        parts.append(Text(f"original record: {original.state.value}"))
    return Group(*parts)


def series_lines(series: Description, now_ms: int) -> list[str]:
    """How ``kdelay show`` describes a recurring series: spec, occurrence, the next one."""
    bounds = [f"until {utc(series.until_ms)}" if series.until_ms is not None else "",
              f"{series.count} occurrences" if series.count is not None else ""]
    limit = ", ".join(b for b in bounds if b) or "no end"
    following = ("none: the series ends with this occurrence" if series.next_due_ms is None
                 else f"{utc(series.next_due_ms)} ({relative(series.next_due_ms, now_ms)})")
    return [f"series {series.schedule_id}: {series.spec} ({limit}), to "
            f"{series.target or 'its task'}",
            f"this is occurrence {series.n}; next occurrence {following}"]


def _held_note(found: Lookup, held: Held) -> str | None:
    """The control that holds a pending request back, or None."""
    original = found.original
    if found.pending is None or original is None:
        return None
    return held(original.target, original.lane)


def show_json(found: Lookup, topic: str, held: Held = _NOT_HELD) -> str:
    """The ``kdelay show --json`` object."""
    entry, original = found.pending, found.original
    record = None if original is None else original.record
    body: dict[str, object] = {
        "reference": found.reference, "status": found.status, "pending": entry is not None,
        "held_by": _held_note(found, held),
        "topic": topic if found.coordinates else None,
        "partition": found.coordinates[0] if found.coordinates else None,
        "offset": found.coordinates[1] if found.coordinates else None,
        "due_ms": None if entry is None else entry.due_ms,
        "id": None if entry is None else entry.schedule_id,
        "original": None if original is None else original.state.value,
        "target": None if original is None else original.target,
        "lane": None if original is None else original.lane,
        "headers": None if record is None else [
            [name, text_of(value)] for name, value in headers_of(record)],
        "key": None if record is None else text_of(record.key()),
        "value_bytes": None if original is None else original.value_bytes,
        "series": None if found.series is None else {
            "id": found.series.schedule_id, "spec": found.series.spec, "n": found.series.n,
            "due_ms": found.series.pending_due_ms, "next_due_ms": found.series.next_due_ms,
            "until_ms": found.series.until_ms, "count": found.series.count,
            "target": found.series.target},
    }
    return orjson.dumps(body).decode()


def retention_json(report: RetentionReport) -> str:
    """The ``kdelay retention check --json`` object."""
    return orjson.dumps({
        "topic": report.topic, "now_ms": report.now_ms,
        "retention_ms": report.retention_ms, "retention_bytes": report.retention_bytes,
        "segment_ms": report.segment_ms, "segment_bytes": report.segment_bytes,
        "local_retention_ms": report.local_retention_ms,
        "at_risk": report.at_risk, "expired": report.expired,
        "longest_pending_delay_ms": report.longest_pending_delay_ms,
        "recommended_retention_ms": report.recommended_retention_ms,
        "problems": report.problems,
        "partitions": [_partition_json(p) for p in report.partitions],
        "at_risk_records": [asdict(record) for record in report.listed],
    }).decode()


def _partition_json(p: PartitionRetention) -> dict[str, object]:
    return {
        "partition": p.partition, "log_start_offset": p.log_start_offset,
        "pending": p.pending, "oldest_pending_offset": p.oldest_pending_offset,
        "oldest_record_ms": p.oldest_record_ms, "oldest_due_ms": p.oldest_due_ms,
        "headroom_ms": p.headroom_ms, "due_in_ms": p.due_in_ms,
        "at_risk": p.at_risk, "expired": p.expired,
    }


def _span_or_dash(ms: int | None) -> str:
    return "-" if ms is None else span(ms)


def _limit(ms: int | None) -> str:
    return "unlimited (-1)" if ms is None else f"{ms} ({span(ms)})"


def retention_tables(report: RetentionReport) -> RenderableType:
    """The ``kdelay retention check`` report: topic settings, partitions, verdict."""
    head = Text(
        f"{report.topic}: retention.ms {_limit(report.retention_ms)}, "
        f"retention.bytes {report.retention_bytes}, segment.ms {_limit(report.segment_ms)}, "
        f"local.retention.ms {_limit(report.local_retention_ms)}\n"
        f"longest pending delay {_span_or_dash(report.longest_pending_delay_ms)}"
        f"; recommended retention.ms {report.recommended_retention_ms} "
        f"({span(report.recommended_retention_ms)})")
    table = Table(title="per partition (oldest pending entry by offset; times UTC)",
                  title_justify="left")
    for name in ("partition", "log start", "pending", "oldest", "record time",
                 "due time", "headroom", "due in", "at risk", "expired"):
        table.add_column(name, no_wrap=name.endswith("time"))
    for p in report.partitions:
        table.add_row(str(p.partition), str(p.log_start_offset), str(p.pending),
                      "-" if p.oldest_pending_offset is None else str(p.oldest_pending_offset),
                      utc_short(p.oldest_record_ms), utc_short(p.oldest_due_ms),
                      _headroom(p),
                      _signed(p.due_in_ms), str(p.at_risk), str(p.expired))
    verdict = Text("\n".join(f"AT RISK: {line}" for line in report.problems)
                   or "ok: every pending original outlives its due time")
    if not report.listed:
        return Group(head, table, verdict)
    risky = Table(title=f"the first {len(report.listed)} at-risk records by due time "
                        "(kdelay show TOPIC/PARTITION/OFFSET for one)", title_justify="left")
    for name in ("record", "due time", "record time", "retention may delete it", "why"):
        risky.add_column(name, no_wrap=True)
    for r in report.listed:
        risky.add_row(f"{report.topic}/{r.partition}/{r.offset}", utc_short(r.due_ms),
                      utc_short(r.record_ms), utc_short(r.expires_ms), r.why)
    return Group(head, table, risky, verdict)


def _headroom(p: PartitionRetention) -> str:
    """The partition's headroom; ``unlimited`` when retention never deletes by time."""
    if p.oldest_pending_offset is not None and p.oldest_pending_offset < p.log_start_offset:
        return "expired"
    return "unlimited" if p.headroom_ms is None and p.pending else _signed(p.headroom_ms)


def _signed(ms: int | None) -> str:
    if ms is None:
        return "-"
    return span(ms) if ms >= 0 else f"-{span(-ms)}"
