"""Scheduling over HTTP: the body checked, then one request as the client library writes it.

No broker: the app's actions are stand-ins (``fakes.py``); the real path is
in the browser tests.
"""

from __future__ import annotations

from typing import Any

import pytest

from kdelay.web.access import Policy
from tests.unit.web.fakes import basic, client, console_app, users_policy

ORDER = {"target": "orders", "value": '{"id": 7}', "id": "order-7", "reason": "api test"}


def _post(body: dict[str, Any]) -> tuple[Any, Any]:
    app, _, actions = console_app(Policy())
    web = client(app)
    token = web.get("/api/v1/session").json()["csrf_token"]
    return web.post("/api/v1/schedules", json=body, headers={"X-CSRF-Token": token}), actions


def test_a_record_is_scheduled_with_its_delay_or_due_time() -> None:
    answer, actions = _post({**ORDER, "delay": "30s", "key": "k", "headers": {"trace": "t1"}})
    assert (answer.status_code, answer.json()["outcome"]) == (200, "scheduled")
    order = actions.orders[0]
    assert (order.target, order.delay_ms, order.due_ms, order.key) == ("orders", 30_000, None, "k")
    assert order.headers == {"trace": "t1"}
    answer, actions = _post({**ORDER, "due": "2030-01-01T00:00:00Z"})
    assert actions.orders[0].due_ms == 1_893_456_000_000


@pytest.mark.parametrize(("body", "code"), [
    ({**ORDER}, "invalid-time"),
    ({**ORDER, "delay": "30s", "due": "2030-01-01T00:00Z"}, "invalid-time"),
    ({**ORDER, "delay": "soon"}, "invalid-time"),
    ({**ORDER, "delay": "1s", "reason": ""}, "reason-required"),
    ({**ORDER, "delay": "1s", "id": ""}, "invalid-id"),
    ({"target": "orders", "delay": "1s", "reason": "r"}, "invalid-argument"),
])
def test_a_bad_schedule_is_400_and_writes_nothing(body: dict[str, Any], code: str) -> None:
    answer, actions = _post(body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, code)
    assert actions.orders == []


def test_a_viewer_cannot_schedule() -> None:
    app, _, actions = console_app(users_policy())
    web = client(app)
    token = web.get("/api/v1/session", headers=basic("vera")).json()["csrf_token"]
    answer = web.post("/api/v1/schedules", json={**ORDER, "delay": "1s"},
                      headers={**basic("vera"), "X-CSRF-Token": token})
    assert (answer.status_code, answer.json()["error"]["code"]) == (403, "forbidden")
    assert actions.orders == []
