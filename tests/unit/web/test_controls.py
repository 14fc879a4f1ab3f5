"""The target controls screen and API: the controls in force, and changes to them.

No broker: the reads and actions are stand-ins (``fakes.py``); the real path (a
pause written, applied by the service and lifted) is in the browser tests.
"""

from __future__ import annotations

from typing import Any

import pytest

from kdelay.protocol.controls import Scope, Subject
from kdelay.web.access import Policy
from tests.unit.web.fakes import NOW_MS, basic, client, console_app, users_policy


def _change(path: str, body: dict[str, Any], who: str | None = None, *,
            csrf: bool = True) -> tuple[int, dict[str, Any], list[Any]]:
    app, _, actions = console_app(users_policy() if who else Policy())
    web = client(app)
    auth = basic(who) if who else {}
    token = web.get("/api/v1/session", headers=auth).json()["csrf_token"]
    headers = {**auth, **({"X-CSRF-Token": token} if csrf else {})}
    answer = web.post(path, json=body, headers=headers)
    return answer.status_code, answer.json(), actions.controls


def test_the_api_lists_each_control_with_what_it_holds_back() -> None:
    app, _, _ = console_app(Policy())
    [item] = client(app).get("/api/v1/controls").json()["items"]
    assert item == {"scope": "target", "name": "orders", "paused_since_ms": NOW_MS - 60_000,
                    "paused_by": "olga", "reason": "orders-db down", "rate_per_s": None,
                    "catch_up_per_s": None, "changed_ms": NOW_MS - 60_000, "changed_by": "olga",
                    "held_back": 12, "oldest_held_due_ms": NOW_MS - 30_000}


def test_an_operator_pauses_resumes_and_caps_a_target_by_name() -> None:
    status, body, done = _change("/api/v1/controls/orders/pause", {"reason": "db failover"},
                                 "olga")
    assert (status, body["paused_by"], body["reason"]) == (200, "olga", "db failover")
    assert done == [("olga", "pause", Subject(Scope.TARGET, "orders"), "db failover", None)]
    status, body, _ = _change("/api/v1/controls/orders/resume",
                              {"reason": "back", "rate": "500/s"})
    assert (status, body["paused_by"], body["catch_up_per_s"]) == (200, None, 500.0)
    status, body, done = _change("/api/v1/controls/gold/limit",
                                 {"reason": "smooth 09:00", "rate": "60000/m", "lane": True})
    assert (status, body["scope"], body["rate_per_s"]) == (200, "lane", 1000.0)
    assert done[0][2] == Subject(Scope.LANE, "gold")


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/api/v1/controls/orders/pause", {"reason": ""}, 400, "reason-required"),
    ("/api/v1/controls/orders/stop", {"reason": "r"}, 400, "invalid-action"),
    ("/api/v1/controls/kdelay.requests/pause", {"reason": "r"}, 400, "bad-control"),
    ("/api/v1/controls/orders/limit", {"reason": "r", "rate": "fast"}, 400, "bad-control"),
    ("/api/v1/controls/orders/limit", {"rate": "5/s"}, 400, "invalid-argument"),
])
def test_a_bad_change_is_refused_with_its_code_and_nothing_written(
        path: str, body: dict[str, Any], status: int, code: str) -> None:
    answered, answer, done = _change(path, body)
    assert (answered, answer["error"]["code"]) == (status, code)
    assert done == []


def test_a_viewer_or_a_request_without_its_csrf_token_changes_nothing() -> None:
    status, answer, done = _change("/api/v1/controls/orders/pause", {"reason": "r"}, "vera")
    assert (status, answer["error"]["code"], done) == (403, "forbidden", [])
    status, answer, done = _change("/api/v1/controls/orders/pause", {"reason": "r"}, "olga",
                                   csrf=False)
    assert (status, answer["error"]["code"], done) == (403, "csrf-failed", [])


def test_the_page_shows_the_controls_and_offers_changes_to_operators_only() -> None:
    app, _, _ = console_app(users_policy())
    web = client(app)
    operator = web.get("/controls", headers=basic("olga")).text
    assert "orders-db down" in operator
    assert 'action="/controls/resume"' in operator
    assert 'id="pause-form"' in operator
    viewer = web.get("/controls", headers=basic("vera")).text
    assert "orders-db down" in viewer
    assert "/controls/resume" not in viewer
    assert 'id="pause-form"' not in viewer
