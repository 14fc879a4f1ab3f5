"""Bulk actions by filter: a dry run counts, the confirmation names the count and acts.

No broker: the app's reads and actions are stand-ins (``fakes.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from kdelay.web.access import Policy
from tests.unit.web.fakes import FakeActions, basic, client, console_app, users_policy


def _web() -> tuple[Any, FakeActions, dict[str, str]]:
    app, reads, actions = console_app(Policy())
    reads.pending_ids = {"bulk-1", "bulk-2", "bulk-3", "other-1"}
    web = client(app)
    token = {"X-CSRF-Token": web.get("/api/v1/session").json()["csrf_token"]}
    return web, actions, token


def test_a_dry_run_counts_and_writes_nothing() -> None:
    web, actions, token = _web()
    answer = web.post("/api/v1/bulk/cancel", headers=token,
                      json={"reason": "clean up", "id_prefix": "bulk-"})
    assert answer.status_code == 200
    assert answer.json() == {"action": "cancel", "matched": 3, "without_id": 1,
                              "due_ms": None, "outcomes": None}
    assert actions.done == []


def test_the_confirmation_acts_on_exactly_the_counted_schedules() -> None:
    web, actions, token = _web()
    body = {"reason": "clean up", "id_prefix": "bulk-", "due": "2030-01-01T00:00Z"}
    dry = web.post("/api/v1/bulk/reschedule", headers=token, json=body).json()
    done = web.post("/api/v1/bulk/reschedule", headers=token,
                    json={**body, "expect": dry["matched"]}).json()
    assert done["outcomes"] == {"rescheduled": 3}
    assert sorted(d.schedule_id for d in actions.done) == ["bulk-1", "bulk-2", "bulk-3"]
    assert {d.action for d in actions.done} == {"bulk-reschedule"}


def test_a_confirmation_whose_count_changed_writes_nothing() -> None:
    web, actions, token = _web()
    answer = web.post("/api/v1/bulk/cancel", headers=token,
                      json={"reason": "clean up", "id_prefix": "bulk-", "expect": 2})
    assert (answer.status_code, answer.json()["error"]["code"]) == (409, "count-changed")
    assert actions.done == []


@pytest.mark.parametrize(("action", "body", "code"), [
    ("cancel", {"reason": "everything"}, "filter-required"),
    ("cancel", {"id_prefix": "bulk-"}, "invalid-argument"),
    ("cancel", {"reason": " ", "id_prefix": "bulk-"}, "reason-required"),
    ("deliver-now", {"reason": "r", "id_prefix": "bulk-"}, "invalid-action"),
    ("reschedule", {"reason": "r", "id_prefix": "bulk-"}, "invalid-time"),
    ("cancel", {"reason": "r", "id_prefix": "bulk-", "expect": -1}, "invalid-argument"),
])
def test_bad_bulk_requests_answer_400(action: str, body: dict[str, Any], code: str) -> None:
    web, actions, token = _web()
    answer = web.post(f"/api/v1/bulk/{action}", headers=token, json=body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, code)
    assert actions.done == []


def test_the_pending_page_runs_dry_then_confirms() -> None:
    web, actions, token = _web()
    form = {"action": "cancel", "reason": "clean up", "id_prefix": "bulk-",
            "csrf": token["X-CSRF-Token"]}
    dry = web.post("/pending/bulk", data=form)
    assert 'id="bulk-count">3<' in dry.text
    assert 'name="expect" value="3"' in dry.text
    done = web.post("/pending/bulk", data={**form, "expect": "3"})
    assert 'data-outcome="cancelled">cancelled 3<' in done.text
    assert len(actions.done) == 3


def test_a_viewer_cannot_bulk_and_a_form_without_csrf_fails() -> None:
    app, _, actions = console_app(users_policy())
    web = client(app)
    token = web.get("/api/v1/session", headers=basic("vera")).json()["csrf_token"]
    viewer = web.post("/pending/bulk", headers=basic("vera"),
                      data={"action": "cancel", "reason": "r", "id_prefix": "o", "csrf": token})
    assert viewer.status_code == 403
    bare = web.post("/pending/bulk", headers=basic("olga"),
                    data={"action": "cancel", "reason": "r", "id_prefix": "o"})
    assert (bare.status_code, "csrf-failed" in bare.text) == (403, True)
    assert actions.done == []
