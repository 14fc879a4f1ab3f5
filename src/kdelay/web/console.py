"""The console's parts, and what every route asks of them: who is calling, may they act.

A :class:`Console` joins the gate (:mod:`~kdelay.web.access`), the reads and
the actions; the app keeps one in ``app.state``. :func:`caller` and
:func:`acting` are the FastAPI dependencies of reading and of acting routes:
acting needs an operator and the CSRF token, from the ``X-CSRF-Token`` header
or a form's ``csrf`` field. :meth:`Console.perform` is the one path of every
action, for the API and the pages alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from kdelay import controls
from kdelay.plumbing.clock import Clock
from kdelay.protocol.controls import Control, Subject
from kdelay.view import deadletters
from kdelay.view.listing import Filter
from kdelay.web.access import Gate, Principal
from kdelay.web.actions import Actions, Done, Order, checked_id, checked_lane, checked_reason
from kdelay.web.inputs import not_pending, parse_time
from kdelay.web.problems import Problem, bad_input
from kdelay.web.reads import Reads

ACTIONS = ("cancel", "reschedule", "deliver-now")
CONTROL_ACTIONS = ("pause", "resume", "limit")
BULK_ACTIONS = ("cancel", "reschedule")
MAX_BULK = 1_000


@dataclass(frozen=True, slots=True)
class Bulk:
    """A bulk action by filter: how many schedules it matches (``matched``, with an id;
    ``without_id`` cannot be named), and after the confirmation the outcomes by name
    (None for a dry run)."""

    action: str
    matched: int
    without_id: int
    due_ms: int | None
    outcomes: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Console:
    """Everything a route needs: who may do what, what to read, how to act."""

    gate: Gate
    reads: Reads
    actions: Actions
    clock: Clock

    def perform(self, who: Principal, action: str, schedule_id: str, reason: str | None,
                due: str | None = None, lane: str | None = None) -> Done:
        """Check the inputs, then cancel, reschedule or deliver now the schedule
        ``schedule_id`` of ``lane`` (None or empty: of no lane; an id is unique within
        its lane), and return the outcome.

        Raises :class:`~kdelay.web.problems.Problem`: 400 ``invalid-action``,
        ``invalid-id``, ``invalid-lane``, ``reason-required``, ``invalid-time``; 409
        ``not-pending`` for a reschedule or a delivery of a schedule the view
        does not hold (a cancel is always written: its outcome says what it found).
        """
        if action not in ACTIONS:
            raise bad_input("invalid-action", f"the action is one of {', '.join(ACTIONS)}")
        schedule_id, lane = checked_id(schedule_id), checked_lane(lane)
        reason = checked_reason(reason)
        if action == "cancel":
            return self.actions.cancel(who, schedule_id, reason, lane)
        due_ms = parse_time(due or "") if action == "reschedule" else None
        if not self.reads.is_pending(schedule_id, lane):
            raise not_pending(schedule_id, lane)
        if due_ms is not None:
            return self.actions.reschedule(who, schedule_id, due_ms, reason, lane)
        return self.actions.deliver_now(who, schedule_id, reason, lane)


    def resend(self, who: Principal, partition: int, offset: int, reason: str | None) -> Done:
        """Send the dead letter at ``partition``/``offset`` of the DLQ again.

        Raises :class:`~kdelay.web.problems.Problem`: 400 ``reason-required``; 404
        ``no-dead-letter`` when the DLQ holds no record there; 409 ``not-resendable``
        for a dead letter that does not carry its request (``mismatch``, ``expired``).
        """
        reason = checked_reason(reason)
        letter = self.reads.dead_letter(partition, offset)
        if letter is None:
            raise Problem(404, "no-dead-letter", f"the DLQ holds no record at "
                          f"{partition}/{offset} (out of range, or deleted by retention)")
        if not deadletters.decode(letter).resendable:
            raise Problem(409, "not-resendable", "this dead letter does not carry its request "
                          "(its original was gone): there is nothing to send again")
        return self.actions.resend(who, letter, reason)

    def control(self, who: Principal, action: str, name: str, lane: bool,
                reason: str | None, rate: str | None = None) -> tuple[Subject, Control]:
        """Pause, resume or cap (``action``) the target ``name`` (a lane with ``lane``),
        as ``kdelay target pause`` (``resume``, ``limit``) does; return the subject and
        the control now in force.

        Every change needs a reason (a pause keeps it in its record). ``rate`` is the
        catch-up rate of a resume, the cap of a limit (none: lift it), as ``500/s``
        or ``30000/m``. Raises :class:`~kdelay.web.problems.Problem`: 400
        ``invalid-action``, ``reason-required``, ``bad-control`` (no name, one of
        kdelay's own topics, a bad rate); 503 ``controls-unavailable``.
        """
        if action not in CONTROL_ACTIONS:
            raise bad_input("invalid-action",
                            f"a control action is one of {', '.join(CONTROL_ACTIONS)}")
        reason = checked_reason(reason)
        subject = controls.subject_of(name.strip(), lane, self.reads.settings)
        return subject, self.actions.control(who, action, subject, reason, rate)

    def schedule(self, who: Principal, order: Order, reason: str | None) -> Done:
        """Check the id and the reason, then schedule ``order`` (see
        :meth:`~kdelay.web.actions.Actions.schedule`)."""
        checked_id(order.schedule_id)
        return self.actions.schedule(who, order, checked_reason(reason))

    def bulk(self, who: Principal, action: str, chosen: Filter, reason: str | None,
             due: str | None = None, expect: int | None = None) -> Bulk:
        """A dry run (``expect`` None) counts what ``chosen`` matches; the confirmation
        (``expect``: the count the dry run showed) acts on exactly that many.

        Raises :class:`~kdelay.web.problems.Problem`: 400 ``invalid-action``,
        ``reason-required``, ``invalid-time``, ``filter-required`` (no filter
        field: a bulk action never means "everything"), ``bulk-too-large``
        (over :data:`MAX_BULK`); 409 ``count-changed`` when the filter now
        matches another count than the confirmation names (nothing written).
        """
        if action not in BULK_ACTIONS:
            raise bad_input("invalid-action", "a bulk action is cancel or reschedule")
        reason = checked_reason(reason)
        due_ms = parse_time(due or "") if action == "reschedule" else None
        if chosen == Filter():
            raise bad_input("filter-required", "a bulk action needs at least one filter")
        ids, without_id = self.reads.ids(chosen)
        if len(ids) > MAX_BULK:
            raise bad_input("bulk-too-large", f"{len(ids)} schedules match; a bulk action "
                            f"takes at most {MAX_BULK}: narrow the filter")
        if expect is None:
            return Bulk(action, len(ids), without_id, due_ms)
        if expect != len(ids):
            raise Problem(409, "count-changed", f"the filter now matches {len(ids)} schedules, "
                          f"not the {expect} confirmed: nothing was written; run it dry again")
        outcomes = self.actions.bulk(who, action, ids, reason, due_ms)
        return Bulk(action, len(ids), without_id, due_ms, outcomes)


def console_of(request: Request) -> Console:
    """The console the app serves."""
    found: Console = request.app.state.console
    return found


def caller(request: Request) -> Principal:
    """Who sends ``request`` (401 ``unauthenticated`` when nobody)."""
    gate = console_of(request).gate
    header = gate.policy.proxy_header
    return gate.identify(client=request.client.host if request.client else None,
                         host=request.headers.get("host"),
                         authorization=request.headers.get("authorization"),
                         proxy_user=request.headers.get(header) if header else None)


async def acting(request: Request, who: Annotated[Principal, Depends(caller)]) -> Principal:
    """The caller of a state-changing request: an operator (403 ``forbidden``) whose
    request carries their CSRF token (403 ``csrf-failed``)."""
    gate = console_of(request).gate
    gate.require_operator(who)
    presented = request.headers.get("x-csrf-token")
    if presented is None and request.headers.get("content-type", "").startswith(
            ("application/x-www-form-urlencoded", "multipart/form-data")):
        field = (await request.form()).get("csrf")
        presented = field if isinstance(field, str) else None
    gate.check_csrf(who, presented)
    return who


Caller = Annotated[Principal, Depends(caller)]
Acting = Annotated[Principal, Depends(acting)]
