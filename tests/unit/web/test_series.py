"""The recurring series screen and API: the rule, the pending occurrence, the next fire
times, and ending a series with a reason (through the cancel every action uses).

No broker: the reads and actions are stand-ins (``fakes.py``); a real series is ended in
the browser tests.
"""

from __future__ import annotations

from kdelay.web.access import Policy
from kdelay.web.reads import SeriesRow, latest
from tests.unit.web.fakes import NOW_MS, basic, client, console_app, users_policy


def test_the_api_lists_each_series_with_its_next_five_fire_times() -> None:
    app, _, _ = console_app(Policy())
    found = client(app).get("/api/v1/series").json()
    [item] = found["items"]
    assert (item["schedule_id"], item["rule"], item["n"]) == ("daily-report", "every 1h", 3)
    assert item["upcoming"] == [NOW_MS + n * 3_600_000 for n in range(1, 6)]


def test_an_operator_ends_a_series_with_a_reason_and_a_viewer_cannot() -> None:
    app, _, actions = console_app(users_policy())
    web = client(app)
    for who, status in (("vera", 403), ("olga", 200)):
        token = web.get("/api/v1/session", headers=basic(who)).json()["csrf_token"]
        answer = web.post("/series/cancel", data={"id": "daily-report", "reason": "retired",
                                                  "csrf": token}, headers=basic(who))
        assert answer.status_code == status
    assert [(d.action, d.schedule_id, d.reason) for d in actions.done] == [
        ("cancel", "daily-report", "retired")]
    assert "cancelled" in answer.text


def test_ending_a_series_needs_a_reason() -> None:
    app, _, actions = console_app(Policy())
    web = client(app)
    token = web.get("/api/v1/session").json()["csrf_token"]
    answer = web.post("/series/cancel", data={"id": "daily-report", "reason": "",
                                              "csrf": token})
    assert answer.status_code == 400
    assert actions.done == []


def test_a_series_with_two_occurrences_pending_for_a_moment_is_listed_once() -> None:
    def row(schedule_id: str, n: int) -> SeriesRow:
        return SeriesRow(schedule_id, "every 2s", n, None, None, "orders", [n * 2_000])

    listed = latest([row("ticks", 1), row("other", 5), row("ticks", 2)])
    assert sorted((r.schedule_id, r.n) for r in listed) == [("other", 5), ("ticks", 2)]
