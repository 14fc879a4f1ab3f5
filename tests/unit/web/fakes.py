"""A console whose reads and actions are stand-ins, for tests of the web layer without Kafka.

The gate, the inputs, the routes, the templates and the error answers are the
real ones; only what lies below them (the view, the producers) is replaced,
so these tests prove who may do what and how bad input is answered.
"""

from __future__ import annotations

import base64

from confluent_kafka import TIMESTAMP_CREATE_TIME, Message
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Settings
from kdelay.protocol.controls import Control, Pause, Scope, Subject, parse_rate
from kdelay.view.backlog import Backlog, HeldBack
from kdelay.view.deadletters import DeadLetter, decode
from kdelay.view.deliveries import Delivery, Latest, lateness
from kdelay.view.listing import DUE, KEY_SCAN, Filter, KeyMatch, Listing, Timeline
from kdelay.view.listing import Order as ListOrder
from kdelay.view.lookup import Lookup
from kdelay.view.members import Member, Membership, PartitionState
from kdelay.view.retention import PartitionRetention, RetentionReport
from kdelay.web.access import Gate, Policy, Principal, hash_secret, parse_users
from kdelay.web.actions import Actions, Done, Order
from kdelay.web.app import create_app
from kdelay.web.console import Console
from kdelay.web.reads import (
    ControlRow,
    LatenessReport,
    Overview,
    Preview,
    Reads,
    Record,
    SeriesList,
    SeriesRow,
    SeriesRun,
)

NOW_MS = 1_795_000_000_000
SECRETS = {"olga": "operator-secret-1", "vera": "viewer-secret-2"}


class FakeReads(Reads):
    """Reads that answer from memory: ``order-42`` of no lane is pending (and what
    ``lane_ids`` names in a lane), nothing else is."""

    def __init__(self) -> None:
        self.pending_ids = {"order-42"}
        self.lane_ids: set[tuple[str, str]] = set()
        self.payload_shown: list[bool] = []
        self.lanes_asked: list[str | None] = []
        self.targets_asked: list[str | None] = []
        self.windows_asked: list[int] = []
        self.fail_with: Exception | None = None
        self.listed: list[tuple[Filter, int, int, ListOrder, KeyMatch | None]] = []
        self.letters: dict[tuple[int, int], Message] = {
            (0, 3): dead_letter(0, 3, "undeliverable", schedule_id="order-9"),
            (1, 5): dead_letter(1, 5, "expired", schedule_id="order-8"),
        }

    @property
    def requests_topic(self) -> str:
        return "kdelay.requests"

    @property
    def settings(self) -> Settings:
        return Settings()

    def controls(self) -> list[ControlRow]:
        paused = Control(paused=Pause(NOW_MS - 60_000, "olga", "orders-db down"),
                         changed_ms=NOW_MS - 60_000, changed_by="olga")
        return [ControlRow(Subject(Scope.TARGET, "orders"), paused,
                           HeldBack(12, NOW_MS - 30_000))]

    def overview(self) -> Overview:
        if self.fail_with is not None:
            raise self.fail_with
        counted = Backlog(NOW_MS, 1, 0, NOW_MS + 60_000, NOW_MS + 60_000, 3_600_000,
                          [(NOW_MS, 1)], {0: 1}, {"orders": 1})
        group = Membership("stable", [Member("host-1", "kdelay", "/10.0.0.1", [0, 1])],
                           {0: 0, 1: 5, 2: None},
                           {0: PartitionState("serving", instance="host-1", as_of_ms=NOW_MS),
                            1: PartitionState("restoring", 250, 1000, "host-1", NOW_MS - 3_000),
                            2: PartitionState("unknown", why="no instance is assigned it")})
        return Overview(NOW_MS, None, counted, {"(none)": 1}, group)

    def pending(self, chosen: Filter, *, skip: int = 0, limit: int = 100,
                order: ListOrder = DUE, key: KeyMatch | None = None) -> Listing:
        self.listed.append((chosen, skip, limit, order, key))
        return Listing(0, [], skip, limit, order, None if key is None else KEY_SCAN,
                       None if key is None else 20_000)

    def timeline(self, bucket_ms: int, chosen: Filter | None = None) -> Timeline:
        return Timeline(bucket_ms, 1, {"orders": {NOW_MS // bucket_ms * bucket_ms: 1}})

    def is_pending(self, schedule_id: str, lane: str | None = None) -> bool:
        if lane is not None:
            return (schedule_id, lane) in self.lane_ids
        return schedule_id in self.pending_ids

    def retention(self) -> RetentionReport:
        figures = PartitionRetention(0, 0, pending=1, oldest_due_ms=NOW_MS + 60_000,
                                     headroom_ms=86_400_000)
        return RetentionReport("kdelay.requests", NOW_MS, 604_800_000, -1, None, None, None,
                               60_000, 7_200_000, [figures])

    def ids(self, chosen: Filter) -> tuple[list[tuple[str, str | None]], int]:
        prefix = chosen.id_prefix or ""
        found: list[tuple[str, str | None]] = [(i, None) for i in self.pending_ids]
        found += [(i, lane) for i, lane in self.lane_ids
                  if chosen.lane is None or lane == chosen.lane]
        return sorted((p for p in found if p[0].startswith(prefix)), key=str), 1

    def series(self, *, limit: int = 200) -> SeriesList:
        hourly = [NOW_MS + n * 3_600_000 for n in range(1, 6)]
        runs = [SeriesRun(2, NOW_MS - 3_600_000, NOW_MS - 3_599_880, 120, "kdelay.series", 0, 8),
                SeriesRun(1, NOW_MS - 7_200_000, NOW_MS - 7_199_950, 50, "kdelay.series", 0, 3)]
        return SeriesList([SeriesRow("daily-report", "every 1h", 3, None, None, "reports",
                                     hourly, runs)], 1)

    def deliveries(self, target: str | None = None, *, limit: int = 100) -> Latest:
        self.targets_asked.append(target)
        shown = [d for d in DELIVERIES if target is None or d.target == target]
        return Latest(shown[:limit], {"orders"} if target is None else set())

    def lateness(self, window_ms: int, target: str | None = None, *,
                 per_partition: int = 2_000) -> LatenessReport:
        self.windows_asked.append(window_ms)
        chosen = [d for d in DELIVERIES if target is None or d.target == target]
        return LatenessReport(NOW_MS, NOW_MS - window_ms, lateness(chosen), set(),
                              ["mail", "orders"] if target is None else [target],
                              lateness(chosen, by_hour=True))

    def dead_letters(self, *, code: str | None = None,
                     per_partition: int = 100) -> list[DeadLetter]:
        return [letter for letter in (decode(m) for m in self.letters.values())
                if code is None or letter.code == code]

    def dead_letter(self, partition: int, offset: int) -> Message | None:
        return self.letters.get((partition, offset))

    def record(self, reference: str, *, show_payload: bool, lane: str | None = None) -> Record:
        self.payload_shown.append(show_payload)
        self.lanes_asked.append(lane)
        payload = Preview("text", "the payload", 11, cut=False) if show_payload else None
        return Record(Lookup(reference, None, None, None, "not pending"), NOW_MS, [], payload,
                      not show_payload, None, [])


class FakeActions(Actions):
    """Actions that record what they were asked and answer as the service would."""

    def __init__(self) -> None:
        self.done: list[Done] = []
        self.orders: list[Order] = []
        self.controls: list[tuple[str, str, Subject, str, str | None]] = []

    def control(self, who: Principal, action: str, subject: Subject, reason: str,
                rate: str | None) -> Control:
        per_s = parse_rate(rate) if rate and rate.strip() else None
        self.controls.append((who.name, action, subject, reason, rate))
        if action == "pause":
            return Control(paused=Pause(NOW_MS, who.name, reason), changed_ms=NOW_MS,
                           changed_by=who.name)
        if action == "resume":
            return Control(catch_up_per_s=per_s, changed_ms=NOW_MS, changed_by=who.name)
        return Control(rate_per_s=per_s, changed_ms=NOW_MS, changed_by=who.name)

    def _answer(self, action: str, who: Principal, schedule_id: str, reason: str,
                outcome: str, due_ms: int | None = None, lane: str | None = None) -> Done:
        done = Done(action, schedule_id, who.name, who.role.value, reason, NOW_MS,
                    "kdelay.requests/0/7", outcome, None, due_ms, lane)
        self.done.append(done)
        return done

    def schedule(self, who: Principal, order: Order, reason: str) -> Done:
        self.orders.append(order)
        return self._answer("schedule", who, order.schedule_id, reason, "scheduled",
                            order.due_ms)

    def cancel(self, who: Principal, schedule_id: str, reason: str,
               lane: str | None = None) -> Done:
        return self._answer("cancel", who, schedule_id, reason, "cancelled", None, lane)

    def reschedule(self, who: Principal, schedule_id: str, due_ms: int, reason: str,
                   lane: str | None = None) -> Done:
        return self._answer("reschedule", who, schedule_id, reason, "rescheduled", due_ms,
                            lane)

    def deliver_now(self, who: Principal, schedule_id: str, reason: str,
                    lane: str | None = None) -> Done:
        return self._answer("deliver-now", who, schedule_id, reason, "rescheduled", NOW_MS,
                            lane)

    def resend(self, who: Principal, letter: Message, reason: str) -> Done:
        return self._answer("resend", who, decode(letter).schedule_id or "", reason, "scheduled")

    def bulk(self, who: Principal, action: str, ids: list[tuple[str, str | None]],
             reason: str, due_ms: int | None = None) -> dict[str, int]:
        outcome = "cancelled" if action == "cancel" else "rescheduled"
        for schedule_id, lane in ids:
            self._answer(f"bulk-{action}", who, schedule_id, reason, outcome, due_ms, lane)
        return {outcome: len(ids)}


DELIVERIES = [
    Delivery("orders", 1, 17, NOW_MS - 1_000, NOW_MS - 1_180, "kdelay.requests/0/5", "order-7"),
    Delivery("mail", 0, 4, NOW_MS - 2_000, NOW_MS - 2_020, "kdelay.requests/1/9"),
]
"""What the fake reads deliver: one with an id (180 ms late), one without (20 ms)."""


def dead_letter(partition: int, offset: int, code: str, *,
                schedule_id: str | None = None) -> Message:
    """A DLQ record as kdelay writes one: the request's headers, then why and from where."""
    headers: list[tuple[str, str | bytes | None]] = [
        ("kdelay-target", b"orders"), ("kdelay-due-ms", str(NOW_MS).encode())]
    if schedule_id is not None:
        headers.append(("kdelay-id", schedule_id.encode()))
    headers += [("kdelay-error", code.encode()), ("kdelay-error-detail", b"why"),
                ("kdelay-origin", b"kdelay.requests/0/1")]
    gone = code in ("mismatch", "expired")
    return Message(topic="kdelay.dlq", partition=partition, offset=offset,
                   key=None if gone else b"k", value=None if gone else b"v", headers=headers,
                   timestamp=(TIMESTAMP_CREATE_TIME, NOW_MS))


def users_policy(**changes: object) -> Policy:
    """A policy with an operator ``olga`` and a viewer ``vera`` (cheap hashes)."""
    entries = ",".join(f"{name}:{role}:{hash_secret(SECRETS[name], iterations=1_000)}"
                       for name, role in (("olga", "operator"), ("vera", "viewer")))
    return Policy(bind="0.0.0.0", users=parse_users(entries), **changes)  # type: ignore[arg-type]  # noqa: S104


def console_app(policy: Policy) -> tuple[FastAPI, FakeReads, FakeActions]:
    """The real app over fake reads and actions."""
    reads, actions = FakeReads(), FakeActions()
    console = Console(Gate(policy, key=b"k" * 32), reads, actions, ManualClock(NOW_MS))
    return create_app(console), reads, actions


def client(app: FastAPI, base_url: str = "http://127.0.0.1:8080") -> TestClient:
    """A client that sees errors as answers, as a browser does."""
    return TestClient(app, base_url=base_url, raise_server_exceptions=False)


def basic(name: str) -> dict[str, str]:
    """The basic-auth header of a configured user."""
    token = base64.b64encode(f"{name}:{SECRETS[name]}".encode()).decode()
    return {"Authorization": f"Basic {token}"}
