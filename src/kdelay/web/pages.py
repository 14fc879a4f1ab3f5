"""The console's pages: server-rendered HTML for the same reads and actions as the API.

Each page calls the functions the API calls (:mod:`~kdelay.web.reads`,
:meth:`~kdelay.web.console.Console.perform`) and renders a template; forms
work without JavaScript, and htmx (``hx-boost``) swaps pages in place where
it runs. Every form that acts carries the CSRF token in a hidden ``csrf`` field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from kdelay.protocol.envelope import ErrorCode
from kdelay.view.deliveries import EDGES_MS
from kdelay.view.display import preview, relative, span, utc
from kdelay.view.listing import BURST_MIN, SCAN_DEPTH
from kdelay.view.members import STALE_MS
from kdelay.web.access import Principal
from kdelay.web.actions import Done, checked_lane
from kdelay.web.console import Acting, Caller, console_of
from kdelay.web.inputs import (
    BUCKETS,
    parse_bucket,
    parse_code,
    parse_filter,
    parse_key,
    parse_order,
    parse_sorted_page,
    parse_target,
    parse_window,
)

TEMPLATES = Jinja2Templates(directory=Path(__file__).parent / "templates")
TEMPLATES.env.filters.update(utc=utc, span=span, short=preview)
TEMPLATES.env.globals.update(relative=relative, buckets=list(BUCKETS), span=span,
                             stale_ms=STALE_MS)
router = APIRouter(include_in_schema=False)
Text = Annotated[str, Form()]
OptionalText = Annotated[str | None, Form()]


def render(request: Request, who: Principal, template: str, status: int = 200,
           **context: Any) -> HTMLResponse:
    """Render ``template`` with the caller, their CSRF token and ``context``."""
    console = console_of(request)
    return TEMPLATES.TemplateResponse(request, template, {
        "who": who, "csrf": console.gate.csrf_token(who), "now_ms": console.clock.now_ms(),
        "topic": console.reads.requests_topic, "freshness": console.reads.freshness(),
        **context}, status_code=status)


@router.get("/", response_class=HTMLResponse)
def overview(request: Request, who: Caller) -> HTMLResponse:
    """Overview: the backlog, split by target and lane, and whether Kafka answers."""
    return render(request, who, "overview.html", found=console_of(request).reads.overview())


@router.get("/pending", response_class=HTMLResponse)
def pending(request: Request, who: Caller, target: str | None = None, lane: str | None = None,
            due_from: str | None = None, due_to: str | None = None,
            id_prefix: str | None = None, key: str | None = None, key_prefix: str | None = None,
            sort: str | None = None, order: str | None = None, skip: int = 0,
            limit: int = 100) -> HTMLResponse:
    """Pending list: filtered, sorted by a column (due time by default), paged, with the
    true total."""
    form = {"target": target or "", "lane": lane or "", "due_from": due_from or "",
            "due_to": due_to or "", "id_prefix": id_prefix or ""}
    view = {"key": key or "", "key_prefix": key_prefix or "", "sort": sort or "due",
            "order": order or "asc"}
    return _pending_page(request, who, form, skip, limit, view)


def _pending_page(request: Request, who: Principal, form: dict[str, str], skip: int = 0,
                  limit: int = 100, view: dict[str, str] | None = None,
                  **extra: Any) -> HTMLResponse:
    """The pending page; ``form`` holds the filters a bulk action takes too, ``view`` the
    sort and the key filter (which a bulk action does not take)."""
    view = view or {"key": "", "key_prefix": "", "sort": "due", "order": "asc"}
    chosen = parse_filter(**form)
    ordered = parse_order(view["sort"], view["order"])
    keyed = parse_key(view["key"], view["key_prefix"])
    skip, limit = parse_sorted_page(skip, limit, ordered)
    found = console_of(request).reads.pending(chosen, skip=skip, limit=limit, order=ordered,
                                              key=keyed)
    return render(request, who, "pending.html", found=found, form=form, view=view,
                  scan_depth=SCAN_DEPTH, **extra)


@router.post("/pending/bulk", response_class=HTMLResponse)
def bulk(request: Request, who: Acting, action: Text, reason: OptionalText = None,
         due: OptionalText = None, expect: Annotated[int | None, Form()] = None,
         target: OptionalText = None, lane: OptionalText = None,
         due_from: OptionalText = None, due_to: OptionalText = None,
         id_prefix: OptionalText = None) -> HTMLResponse:
    """Bulk cancel or reschedule by the list's filter: a dry run, then the confirmation."""
    form = {"target": target or "", "lane": lane or "", "due_from": due_from or "",
            "due_to": due_to or "", "id_prefix": id_prefix or ""}
    found = console_of(request).bulk(who, action, parse_filter(**form), reason, due, expect)
    return _pending_page(request, who, form, bulk=found, bulk_reason=reason or "",
                         bulk_due=due or "")


@router.get("/timeline", response_class=HTMLResponse)
def timeline(request: Request, who: Caller, bucket: str = "1h",
             target: str | None = None, lane: str | None = None) -> HTMLResponse:
    """Timeline: pending entries by due bucket, per target."""
    found = console_of(request).reads.timeline(parse_bucket(bucket), parse_filter(target, lane))
    return render(request, who, "timeline.html", found=found, bucket=bucket, burst_min=BURST_MIN,
                  form={"target": target or "", "lane": lane or ""})


@router.get("/retention", response_class=HTMLResponse)
def retention(request: Request, who: Caller) -> HTMLResponse:
    """Retention guard: pending originals retention may delete before they are due."""
    return render(request, who, "retention.html", report=console_of(request).reads.retention())


@router.get("/series", response_class=HTMLResponse)
def series(request: Request, who: Caller) -> HTMLResponse:
    """Recurring series: each one's rule, pending occurrence and next fire times."""
    return render(request, who, "series.html", found=console_of(request).reads.series())


@router.post("/series/cancel", response_class=HTMLResponse)
def cancel_series(request: Request, who: Acting, id: Text,
                  reason: OptionalText = None) -> HTMLResponse:
    """End a series (as ``kdelay cancel`` does); shows the outcome."""
    console = console_of(request)
    done = console.perform(who, "cancel", id, reason)
    return render(request, who, "series.html", found=console.reads.series(), done=done)


@router.get("/dead-letters", response_class=HTMLResponse)
def dead_letters(request: Request, who: Caller, code: str | None = None) -> HTMLResponse:
    """Dead letters: the latest DLQ records with their codes; send one again."""
    return _dead_letters_page(request, who, code)


def _dead_letters_page(request: Request, who: Principal, code: str | None,
                       **extra: Any) -> HTMLResponse:
    chosen = parse_code(code)
    found = console_of(request).reads.dead_letters(code=chosen)
    return render(request, who, "dead_letters.html", letters=found, code=chosen or "",
                  codes=[member.value for member in ErrorCode], **extra)


@router.post("/dead-letters/resend", response_class=HTMLResponse)
def resend(request: Request, who: Acting, partition: Annotated[int, Form()],
           offset: Annotated[int, Form()], reason: OptionalText = None) -> HTMLResponse:
    """Send a dead letter again; shows where the request went and its outcome."""
    done = console_of(request).resend(who, partition, offset, reason)
    return _dead_letters_page(request, who, None, done=done)


@router.get("/controls", response_class=HTMLResponse)
def target_controls(request: Request, who: Caller) -> HTMLResponse:
    """Target controls: the pauses and caps in force, what each holds back; change them."""
    return _controls_page(request, who)


def _controls_page(request: Request, who: Principal, **extra: Any) -> HTMLResponse:
    found = console_of(request).reads.controls()
    return render(request, who, "controls.html", rows=found, **extra)


@router.post("/controls/{action}", response_class=HTMLResponse)
def change_control(request: Request, who: Acting, action: str, name: Text,
                   reason: OptionalText = None, rate: OptionalText = None,
                   scope: OptionalText = None) -> HTMLResponse:
    """Pause, resume or limit a target (or a lane: ``scope``); shows the control now."""
    subject, control = console_of(request).control(who, action, name, scope == "lane",
                                                   reason, rate)
    return _controls_page(request, who, changed=subject, control=control)


@router.get("/deliveries", response_class=HTMLResponse)
def deliveries(request: Request, who: Caller, target: str | None = None) -> HTMLResponse:
    """History: the newest deliveries, by target, with id, due and delivery times,
    lateness and target offset."""
    chosen = parse_target(target)
    found = console_of(request).reads.deliveries(chosen)
    return render(request, who, "deliveries.html", found=found, target=chosen or "")


@router.get("/lateness", response_class=HTMLResponse)
def lateness(request: Request, who: Caller, window: str = "1h",
             target: str | None = None) -> HTMLResponse:
    """Lateness: per target, percentiles and a histogram over a recent window."""
    chosen = parse_target(target)
    found = console_of(request).reads.lateness(parse_window(window), chosen)
    return render(request, who, "lateness.html", report=found, window=window,
                  target=chosen or "", edges=EDGES_MS)


def _record_page(request: Request, who: Principal, reference: str,
                 done: Done | None = None, lane: str | None = None) -> HTMLResponse:
    console = console_of(request)
    shown = who.can_act or console.gate.policy.payloads_for_viewers
    found = console.reads.record(reference, show_payload=shown, lane=lane)
    return render(request, who, "record.html", record=found, done=done)


@router.get("/record", response_class=HTMLResponse)
def record(request: Request, who: Caller, ref: str = "", lane: str = "") -> HTMLResponse:
    """Record: one request by id or coordinates, its original, retention and trace; an
    id of ``lane`` when given, else of no lane first, then of each lane."""
    if not ref.strip():
        return render(request, who, "find.html")
    return _record_page(request, who, ref.strip(), lane=checked_lane(lane))


@router.post("/record/{action}", response_class=HTMLResponse)
def act(request: Request, who: Acting, action: str, id: Text, reason: OptionalText = None,
        due: OptionalText = None, lane: OptionalText = None) -> HTMLResponse:
    """Cancel, reschedule or deliver now from the record page (the schedule of ``lane``,
    a hidden field); shows the outcome."""
    done = console_of(request).perform(who, action, id, reason, due, lane)
    return _record_page(request, who, done.schedule_id, done, done.lane)
