"""Commands that write requests: ``kdelay send`` (one record or a recurring series) and
``kdelay cancel``."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated

import typer

from kdelay import recurring
from kdelay.cli.options import (
    USER_ERROR_EXIT,
    common_options,
    connected,
    fail,
    failed,
    option,
    reported,
    settings_of,
)
from kdelay.client import DelayProducer, Ticket, parse_due, parse_header
from kdelay.outcomes import EXIT_CODES, NO_OUTCOME_EXIT, NoOutcome
from kdelay.plumbing.clock import SystemClock
from kdelay.protocol.durations import parse_duration_ms
from kdelay.recurring import SERIES_TOPIC


@dataclass(frozen=True)
class SeriesOptions:
    """The recurring options of ``kdelay send``."""

    every: str | None
    cron: str | None
    tz: str
    until: str | None
    count: int | None
    series_topic: str


@common_options
def send(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="Topic to deliver the record to.")],
    value: Annotated[str | None, option("value", "Record value (UTF-8); null if not given.")]
    = None,
    key: Annotated[str | None, option("key", "Record key (UTF-8).")] = None,
    header: Annotated[list[str] | None, option(
        "header", "A user header; repeatable.", metavar="NAME=VALUE")] = None,
    delay: Annotated[str | None, option(
        "delay", "Delay after the record's timestamp: 1500, 1500ms, 30s, 5m, 2h, 1d.")] = None,
    due: Annotated[str | None, option(
        "due", "Due time: epoch ms or ISO-8601 with a timezone.")] = None,
    level: Annotated[int | None, option("level", "Delay level, 1-based.")] = None,
    schedule_id: Annotated[str | None, option(
        "id", "Schedule id: dedupes, and is the handle for cancel.")] = None,
    partition: Annotated[int | None, option("partition", "Target partition.")] = None,
    lane: Annotated[str | None, option(
        "lane", "The request's lane (kdelay-lane): a service run with --lanes delivers it "
        "only to that lane's topics.")] = None,
    every: Annotated[str | None, option(
        "every", "Recurring: every interval (5m, 1h); needs `kdelay worker`.")] = None,
    cron: Annotated[str | None, option(
        "cron", "Recurring: a cron expression (\"0 9 * * MON-FRI\"); needs `kdelay worker`.")]
    = None,
    tz: Annotated[str, option("tz", "Time zone of --cron (IANA name).", shown="UTC")] = "UTC",
    until: Annotated[str | None, option(
        "until", "Recurring: no occurrence after this time (epoch ms or ISO-8601).")] = None,
    count: Annotated[int | None, option("count", "Recurring: at most this many times.")]
    = None,
    series_topic: Annotated[str, option(
        "series-topic", "Recurring: topic the worker reads occurrences from.",
        shown=SERIES_TOPIC)] = SERIES_TOPIC,
    wait: Annotated[bool, option(
        "wait", "With --id: wait for the service's outcome, print it and exit with its status "
        "(scheduled 0, duplicate 3, none in time 7).")] = False,
    timeout: Annotated[str, option(
        "timeout", "How long --wait waits for the outcome.", shown="30s")] = "30s",
) -> None:
    """Send one record to TARGET through kdelay; print its request's topic/partition/offset.

    Give exactly one of --delay, --due and --level; or --every or --cron for a
    recurring record (then print its id and first due time too).
    """
    if every is not None or cron is not None:
        if delay is not None or due is not None or level is not None:
            fail("invalid-argument", "--every and --cron exclude --delay, --due and --level",
                 USER_ERROR_EXIT)
        if lane is not None:
            fail("invalid-argument", "--lane applies to single records; a recurring series "
                 "has no lane", USER_ERROR_EXIT)
        _send_series(ctx, target, value, key, header, schedule_id,
                     SeriesOptions(every, cron, tz, until, count, series_topic))
        return
    if wait and schedule_id is None:
        fail("invalid-argument", "--wait needs --id: only requests with an id get an outcome",
             USER_ERROR_EXIT)
    with reported():
        settings = settings_of(ctx)
        wait_s = parse_duration_ms(timeout) / 1000
        headers = [parse_header(h) for h in header or ()]
        delay_ms = parse_duration_ms(delay) if delay is not None else None
        due_ms = parse_due(due) if due is not None else None
        with DelayProducer(settings, lane=lane) as producer:
            if not wait or schedule_id is None:
                typer.echo(str(producer.send(target, value, key=key, headers=headers,
                                             delay=delay_ms, due=due_ms, level=level,
                                             partition=partition, id=schedule_id)))
                return
            ticket = producer.schedule(target, value, id=schedule_id, key=key, headers=headers,
                                       delay=delay_ms, due=due_ms, level=level,
                                       partition=partition)
    _answer(ticket, wait_s)


def _answer(ticket: Ticket, timeout_s: float | None) -> None:
    """Print the request's coordinates and, given ``timeout_s`` (--wait), its outcome;
    then exit with the outcome's status."""
    typer.echo(str(ticket))
    if timeout_s is None:
        return
    try:
        answer = ticket.outcome(timeout_s)
    except NoOutcome as exc:
        failed(exc)
    detail = [f"{name}={value}" for name, value in (
        ("schedule", answer.schedule), ("first", answer.first)) if value is not None]
    if answer.differs:
        detail.append("differs=payload-or-due-time")
    if answer.lane is not None:
        detail.append(f"lane={answer.lane}")
    typer.echo(" ".join([answer.outcome, answer.schedule_id, *detail]))
    raise typer.Exit(EXIT_CODES.get(answer.outcome, NO_OUTCOME_EXIT))


def _send_series(ctx: typer.Context, target: str, value: str | None, key: str | None,
                 header: list[str] | None, schedule_id: str | None,
                 options: SeriesOptions) -> None:
    """``kdelay send --every|--cron``: start a plain record series, print where and when."""
    with reported():
        settings = settings_of(ctx)
        now_ms = SystemClock().now_ms()
        spec = recurring.spec_of(options.every, options.cron, options.tz, now_ms)
        series_id = schedule_id or f"series-{uuid.uuid4().hex}"
        coordinates, first_ms = recurring.send_series(
            settings, target, value, spec, schedule_id=series_id, now_ms=now_ms, key=key,
            headers=[parse_header(h) for h in header or ()],
            until_ms=parse_due(options.until) if options.until is not None else None,
            count=options.count, series_topic=options.series_topic)
    typer.echo(f"{coordinates} id={series_id} first-due-ms={first_ms}")


@common_options
def cancel(
    ctx: typer.Context,
    schedule_id: Annotated[str, typer.Argument(metavar="ID", help="The schedule id to cancel.")],
    lane: Annotated[str | None, option(
        "lane", "The lane of the schedule (kdelay-lane): an id is unique within its lane, "
        "and a request reaches only its own lane's schedule.")] = None,
    wait: Annotated[bool, option(
        "wait", "Wait for the service's outcome, print it and exit with its status (cancelled "
        "0, unknown 4, already-delivered 5, dead-lettered 6, none in time 7).")] = False,
    timeout: Annotated[str, option(
        "timeout", "How long --wait waits for the outcome.", shown="30s")] = "30s",
) -> None:
    """Cancel the pending schedule ID, or end the series ID; print the cancel's coordinates
    (and with --wait its outcome)."""
    with reported():
        settings = connected(ctx)
        wait_s = parse_duration_ms(timeout) / 1000
        with DelayProducer(settings, lane=lane) as producer:
            ticket = recurring.cancel(settings, producer, schedule_id,
                                      SystemClock().now_ms(), settings.series_cancels_topic)
    _answer(ticket, wait_s if wait else None)


@common_options
def reschedule(
    ctx: typer.Context,
    schedule_id: Annotated[str, typer.Argument(metavar="ID", help="The schedule id to move.")],
    lane: Annotated[str | None, option(
        "lane", "The lane of the schedule (kdelay-lane): an id is unique within its lane, "
        "and a request reaches only its own lane's schedule.")] = None,
    delay: Annotated[str | None, option(
        "delay", "New due time, from now: 1500, 30s, 5m, 2h, 1d.")] = None,
    due: Annotated[str | None, option(
        "due", "New due time: epoch ms or ISO-8601 with a timezone.")] = None,
    wait: Annotated[bool, option(
        "wait", "Wait for the service's outcome, print it and exit with its status "
        "(rescheduled 0, unknown 4, already-delivered 5, dead-lettered 6, none in time 7).")]
    = False,
    timeout: Annotated[str, option(
        "timeout", "How long --wait waits for the outcome.", shown="30s")] = "30s",
) -> None:
    """Move the pending schedule ID to a new due time, keeping its record; print the
    request's coordinates (and with --wait its outcome)."""
    if (delay is None) == (due is None):
        fail("invalid-argument", "give exactly one of --delay and --due", USER_ERROR_EXIT)
    with reported():
        settings = connected(ctx)
        wait_s = parse_duration_ms(timeout) / 1000
        with DelayProducer(settings, lane=lane) as producer:
            ticket = producer.reschedule(
                schedule_id, delay=parse_duration_ms(delay) if delay is not None else None,
                due=parse_due(due) if due is not None else None)
    _answer(ticket, wait_s if wait else None)

