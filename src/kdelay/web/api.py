"""The JSON API under ``/api/v1``: the console's reads and actions for scripts and pages.

Same roles, codes and outcomes as the pages (both go through
:mod:`~kdelay.web.console`). Reads need any authenticated caller; actions an
operator and the CSRF token of ``GET /api/v1/session`` in ``X-CSRF-Token``.
Errors answer ``{"error": {"code", "message"}}``; the schema is at
``/api/v1/openapi.json``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from kdelay.protocol.durations import parse_duration_ms
from kdelay.view import deliveries as deliveries_view
from kdelay.view.backlog import HeldBack
from kdelay.view.deadletters import DeadLetter
from kdelay.view.display import preview as short
from kdelay.view.display import retention_json
from kdelay.view.pending import Original, Pending
from kdelay.web.actions import Order, checked_lane
from kdelay.web.console import Acting, Caller, Console, console_of
from kdelay.web.inputs import (
    parse_bucket,
    parse_code,
    parse_filter,
    parse_key,
    parse_order,
    parse_page,
    parse_sorted_page,
    parse_target,
    parse_time,
    parse_window,
)
from kdelay.web.problems import bad_input
from kdelay.web.reads import ControlRow, Overview, Record

router = APIRouter(tags=["console"])


class ActionBody(BaseModel):
    """An action on one schedule: its id, its lane (absent: no lane; an id is unique
    within its lane), why, and for a reschedule the new due time (epoch ms, ISO-8601
    with a timezone, or ``YYYY-MM-DDTHH:MM`` in UTC; past means now)."""

    id: str = Field(max_length=512)
    reason: str = Field(max_length=500)
    due: str | None = Field(default=None, max_length=64)
    lane: str | None = Field(default=None, max_length=64)


class ScheduleBody(BaseModel):
    """A record to schedule: the target, the value (UTF-8 text), an optional key and
    headers, exactly one of ``delay`` (``30s``, ``5m``, ms) and ``due`` (as for a
    reschedule), the schedule id (required: its outcome and audit are found by it),
    an optional lane, and why."""

    target: str = Field(max_length=249)
    value: str | None = Field(default=None, max_length=1_000_000)
    id: str = Field(max_length=512)
    reason: str = Field(max_length=500)
    key: str | None = Field(default=None, max_length=10_000)
    headers: dict[str, str] = Field(default_factory=dict, max_length=100)
    delay: str | None = Field(default=None, max_length=32)
    due: str | None = Field(default=None, max_length=64)
    lane: str | None = Field(default=None, max_length=64)


class ReasonBody(BaseModel):
    """Why: every action needs a reason."""

    reason: str = Field(max_length=500)


class BulkBody(BaseModel):
    """A bulk cancel or reschedule by filter. Without ``expect`` it is a dry run that
    counts; with ``expect`` (the dry run's count) it acts, unless the count changed."""

    reason: str = Field(max_length=500)
    due: str | None = Field(default=None, max_length=64)
    expect: int | None = Field(default=None, ge=0)
    target: str | None = Field(default=None, max_length=249)
    lane: str | None = Field(default=None, max_length=64)
    due_from: str | None = Field(default=None, max_length=64)
    due_to: str | None = Field(default=None, max_length=64)
    id_prefix: str | None = Field(default=None, max_length=512)


def entry_json(entry: Pending, original: Original, topic: str) -> dict[str, Any]:
    """One pending entry with what its original says (no payload)."""
    return {"id": entry.schedule_id, "due_ms": entry.due_ms, "record_ms": entry.record_ms,
            "request": f"{topic}/{entry.partition}/{entry.offset}", "state": original.state.value,
            "target": original.target, "lane": original.lane,
            "key": None if original.key is None else short(original.key),
            "value_bytes": original.value_bytes}


def overview_json(found: Overview) -> dict[str, Any]:
    """The overview as JSON; counts are null when Kafka does not answer."""
    counted = found.backlog
    return {"now_ms": found.now_ms, "kafka_answers": found.kafka_error is None,
            "kafka_error": found.kafka_error,
            "pending": None if counted is None else counted.pending,
            "ready_now": None if counted is None else counted.overdue,
            "oldest_overdue_ms": found.oldest_overdue_ms,
            "furthest_due_ms": None if counted is None else counted.latest_due_ms,
            "by_target": None if counted is None else counted.by_target,
            "by_partition": None if counted is None else counted.by_partition,
            "by_lane": found.lanes,
            "group": None if found.group is None else asdict(found.group)}


def record_json(found: Record, topic: str) -> dict[str, Any]:
    """The record screen as JSON; ``payload`` is null when hidden or absent."""
    lookup = found.found
    pending = lookup.pending
    return {
        "reference": lookup.reference, "status": lookup.status,
        "request": None if lookup.coordinates is None else "{}/{}/{}".format(
            topic, *lookup.coordinates),
        "id": None if pending is None else pending.schedule_id,
        "lane": found.lane,
        "due_ms": None if pending is None else pending.due_ms,
        "target": None if lookup.original is None else lookup.original.target,
        "headers": [{"name": n, "value": v} for n, v in found.headers],
        "payload": None if found.payload is None else asdict(found.payload),
        "payload_hidden": found.hidden, "expires_ms": found.expires_ms,
        "headroom_ms": found.headroom_ms,
        "trace": [asdict(step) for step in found.trace],
    }


@router.get("/session")
def session(request: Request, who: Caller) -> dict[str, Any]:
    """Who you are, your role, and the CSRF token your actions must carry."""
    console = console_of(request)
    return {"name": who.name, "role": who.role.value,
            "csrf_token": console.gate.csrf_token(who),
            "payloads_visible": who.can_act or console.gate.policy.payloads_for_viewers}


@router.get("/overview")
def overview(request: Request, _: Caller) -> dict[str, Any]:
    """Pending total, ready now, oldest overdue, furthest due, by target, partition and lane."""
    return overview_json(console_of(request).reads.overview())


def _as_of(console: Console) -> dict[str, int | None]:
    """``as_of_ms``: when the summary the counts come from was taken (absent: read now)."""
    fresh = console.reads.freshness()
    return {} if fresh is None else {"as_of_ms": fresh.as_of_ms}


@router.get("/schedules")
def schedules(request: Request, _: Caller, target: str | None = None, lane: str | None = None,
              due_from: str | None = None, due_to: str | None = None,
              id_prefix: str | None = None, key: str | None = None,
              key_prefix: str | None = None, sort: str | None = None, order: str | None = None,
              skip: int = 0, limit: int = 100) -> dict[str, Any]:
    """Pending schedules, filtered and sorted (by due time unless ``sort`` says else);
    ``total`` counts every match (among the first ``capped`` when set)."""
    chosen = parse_filter(target, lane, due_from, due_to, id_prefix)
    ordered = parse_order(sort, order)
    keyed = parse_key(key, key_prefix)
    skip, limit = parse_sorted_page(skip, limit, ordered)
    console = console_of(request)
    found = console.reads.pending(chosen, skip=skip, limit=limit, order=ordered, key=keyed)
    topic = console.reads.requests_topic
    return {"total": found.total, "skip": skip, "limit": limit, **_as_of(console),
            "sort": ordered.sort, "order": "desc" if ordered.descending else "asc",
            "capped": found.capped, "of": found.of,
            "items": [entry_json(e, o, topic) for e, o in found.rows]}


@router.get("/schedules/{reference:path}")
def schedule(request: Request, who: Caller, reference: str,
             lane: str | None = None) -> dict[str, Any]:
    """One request by schedule id or ``topic/partition/offset``, with its trace. An id
    is looked up in ``lane`` when given, else of no lane first, then in each lane."""
    console = console_of(request)
    shown = who.can_act or console.gate.policy.payloads_for_viewers
    found = console.reads.record(reference, show_payload=shown, lane=checked_lane(lane))
    return record_json(found, console.reads.requests_topic)


@router.get("/retention")
def retention(request: Request, _: Caller) -> Any:
    """``kdelay retention check --json``: originals retention may delete before they are due."""
    return orjson.loads(retention_json(console_of(request).reads.retention()))


@router.get("/timeline")
def timeline(request: Request, _: Caller, bucket: str = "1h", target: str | None = None,
             lane: str | None = None, due_from: str | None = None,
             due_to: str | None = None) -> dict[str, Any]:
    """Pending entries by due bucket (1m, 1h, 1d), per target, and each bucket's
    same-second burst (its busiest second, when it holds 100 entries or more)."""
    bucket_ms = parse_bucket(bucket)
    chosen = parse_filter(target, lane, due_from, due_to)
    found = console_of(request).reads.timeline(bucket_ms, chosen)
    return {"bucket_ms": found.bucket_ms, "total": found.total, **_as_of(console_of(request)),
            "targets": {t: sorted(c.items()) for t, c in found.by_target.items()},
            "bursts": [{"bucket_ms": start, "second_ms": second, "count": count}
                       for start, (second, count) in sorted(found.bursts.items())]}


@router.get("/series")
def series(request: Request, _: Caller) -> dict[str, Any]:
    """Recurring series with a pending occurrence: rule, occurrence ``n`` (of ``count``,
    until ``until_ms``), target and the next fire times (``upcoming``, the pending one
    first). End one with ``POST /api/v1/actions/cancel`` and its id."""
    found = console_of(request).reads.series()
    return {"pending": found.pending, "items": [asdict(row) for row in found.rows]}


def dead_letter_json(letter: DeadLetter) -> dict[str, Any]:
    """One dead letter: where it lies in the DLQ, when, why, and what it was for."""
    return {**asdict(letter), "resendable": letter.resendable}


@router.get("/dead-letters")
def dead_letters(request: Request, _: Caller, code: str | None = None) -> dict[str, Any]:
    """The latest dead letters (the last 100 of each DLQ partition), newest first; those
    of ``code`` only when given."""
    chosen = parse_code(code)
    found = console_of(request).reads.dead_letters(code=chosen)
    return {"items": [dead_letter_json(letter) for letter in found]}


@router.get("/deliveries")
def deliveries(request: Request, _: Caller, target: str | None = None,
               limit: int = 100) -> dict[str, Any]:
    """The newest deliveries (read from the targets' newest records: the last 200 of each
    target partition), newest first, at most ``limit``; to ``target`` only, when given.
    Each has its target offset, due and delivery times, lateness, and the schedule id
    and lane its request carries (null once the request is gone, or without an id)."""
    limit = parse_page(0, limit)[1]
    found = console_of(request).reads.deliveries(parse_target(target), limit=limit)
    return {"items": [{**asdict(d), "lateness_ms": d.lateness_ms} for d in found.deliveries],
            "capped": sorted(found.capped)}


@router.get("/lateness")
def lateness(request: Request, _: Caller, window: str = "1h",
             target: str | None = None) -> dict[str, Any]:
    """Lateness (delivery minus due time, ms) per target over the deliveries of the last
    ``window`` (``15m``, ``1h``, ``1d``): count, early (must be 0), p50, p95, p99, max,
    and the histogram's bins (``edges_ms``: each bin's lower bound); ``hours`` the same
    per target and hour of delivery (``hour_ms``, UTC), newest first. ``capped`` names
    targets whose window held more records than were read."""
    found = console_of(request).reads.lateness(parse_window(window), parse_target(target))
    return {"now_ms": found.now_ms, "since_ms": found.since_ms,
            "edges_ms": list(deliveries_view.EDGES_MS),
            "targets": [asdict(row) for row in found.rows],
            "hours": [asdict(row) for row in found.hours], "read": found.targets,
            "capped": sorted(found.capped)}


@router.post("/dead-letters/{partition}/{offset}/resend")
def resend(request: Request, who: Acting, partition: int, offset: int,
           body: ReasonBody) -> dict[str, Any]:
    """Send a dead letter again to the requests topic, as the request it carries; with
    an id, answers ``scheduled`` or ``duplicate``."""
    return asdict(console_of(request).resend(who, partition, offset, body.reason))


class ControlBody(BaseModel):
    """A change of a target's (or, with ``lane``, a lane's) control: why, and the rate
    (``500/s``, ``30000/m``): a resume's catch-up rate, a limit's cap (absent: lift it)."""

    reason: str = Field(max_length=500)
    rate: str | None = Field(default=None, max_length=32)
    lane: bool = False


def control_json(row: ControlRow) -> dict[str, Any]:
    """One control in force: its subject, who paused it and why, the rates, and the due
    records it holds back (counted from the console's view)."""
    control, paused = row.control, row.control.paused
    return {"scope": row.subject.scope.value, "name": row.subject.name,
            "paused_since_ms": None if paused is None else paused.since_ms,
            "paused_by": None if paused is None else paused.by,
            "reason": None if paused is None else paused.reason,
            "rate_per_s": control.rate_per_s, "catch_up_per_s": control.catch_up_per_s,
            "changed_ms": control.changed_ms, "changed_by": control.changed_by,
            "held_back": row.held.count, "oldest_held_due_ms": row.held.oldest_due_ms}


@router.get("/controls")
def target_controls(request: Request, _: Caller) -> dict[str, Any]:
    """Every target control in force, with what each holds back."""
    return {"items": [control_json(row) for row in console_of(request).reads.controls()]}


@router.post("/controls/{name}/{action}")
def change_control(request: Request, who: Acting, name: str, action: str,
                   body: ControlBody) -> dict[str, Any]:
    """Pause, resume or limit (``action``) the target ``name`` (a lane with ``lane``);
    answers the control now in force."""
    subject, control = console_of(request).control(who, action, name, body.lane, body.reason,
                                                   body.rate)
    return control_json(ControlRow(subject, control, HeldBack()))


@router.post("/schedules")
def schedule_record(request: Request, who: Acting, body: ScheduleBody) -> dict[str, Any]:
    """Schedule a record through the request protocol; answers ``scheduled`` or
    ``duplicate`` (an id already pending, or remembered)."""
    if (body.delay is None) == (body.due is None):
        raise bad_input("invalid-time", "give exactly one of delay and due")
    try:
        delay_ms = None if body.delay is None else parse_duration_ms(body.delay)
    except ValueError as exc:
        raise bad_input("invalid-time", str(exc)) from None
    order = Order(body.target, body.value, body.id, body.key, body.headers, delay_ms,
                  None if body.due is None else parse_time(body.due), body.lane)
    return asdict(console_of(request).schedule(who, order, body.reason))


@router.post("/bulk/{action}")
def bulk(request: Request, who: Acting, action: str, body: BulkBody) -> dict[str, Any]:
    """Bulk cancel or reschedule by filter: a dry run counts, the confirmation acts."""
    chosen = parse_filter(body.target, body.lane, body.due_from, body.due_to, body.id_prefix)
    found = console_of(request).bulk(who, action, chosen, body.reason, body.due, body.expect)
    return asdict(found)


@router.post("/actions/{action}")
def act(request: Request, who: Acting, action: str, body: ActionBody) -> dict[str, Any]:
    """Cancel, reschedule or deliver now (``action``); answers the service's outcome."""
    return asdict(console_of(request).perform(who, action, body.id, body.reason, body.due,
                                              body.lane))
