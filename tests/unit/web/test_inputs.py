"""Bad input answers 400 with a stable code, never a traceback; the schema is served.

No broker: the app's reads and actions are stand-ins (``fakes.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from kdelay.view.listing import DUE, KEY_SCAN, KeyMatch, Order
from kdelay.web.access import Policy
from kdelay.web.inputs import parse_filter, parse_time
from kdelay.web.problems import Problem
from tests.unit.web.fakes import client, console_app


def test_times_parse_from_epoch_iso_and_the_picker() -> None:
    assert parse_time("1767225600000") == 1_767_225_600_000
    assert parse_time("2026-01-01T00:00:00Z") == 1_767_225_600_000
    assert parse_time("2026-01-01T01:00:00+01:00") == 1_767_225_600_000
    assert parse_time("2026-01-01T00:00") == 1_767_225_600_000  # a picker's value: UTC
    assert parse_time("2026-01-01T00:00:30") == 1_767_225_630_000


@pytest.mark.parametrize("text", ["", "soon", "2026-13-01T00:00", "12345678901234567890",
                                  "2026-01-01"])
def test_a_bad_time_is_invalid_time(text: str) -> None:
    with pytest.raises(Problem) as caught:
        parse_time(text)
    assert (caught.value.status, caught.value.code) == (400, "invalid-time")


def test_filters_ignore_empty_fields() -> None:
    chosen = parse_filter(" orders ", "", "2026-01-01T00:00", None, "order-")
    assert (chosen.target, chosen.lane, chosen.id_prefix) == ("orders", None, "order-")
    assert chosen.due_from_ms == 1_767_225_600_000
    assert chosen.due_to_ms is None


def _session(web: Any) -> dict[str, str]:
    return {"X-CSRF-Token": web.get("/api/v1/session").json()["csrf_token"]}


@pytest.mark.parametrize(("path", "code"), [
    ("/api/v1/schedules?limit=0", "invalid-page"),
    ("/api/v1/schedules?limit=abc", "invalid-argument"),
    ("/api/v1/schedules?skip=-1", "invalid-page"),
    ("/api/v1/schedules?target=no/such", "invalid-filter"),
    ("/api/v1/schedules?lane=-x", "invalid-filter"),
    ("/api/v1/schedules?due_from=2026-01-02T00:00&due_to=2026-01-01T00:00", "invalid-filter"),
    ("/api/v1/schedules?due_from=tomorrow", "invalid-time"),
    ("/api/v1/timeline?bucket=2m", "invalid-bucket"),
    ("/pending?limit=5000", "invalid-page"),
    ("/timeline?bucket=week", "invalid-bucket"),
])
def test_bad_queries_answer_400_with_a_code(path: str, code: str) -> None:
    app, _, _ = console_app(Policy())
    answer = client(app).get(path)
    assert answer.status_code == 400
    if path.startswith("/api/"):
        assert answer.json()["error"]["code"] == code
    else:
        assert f'id="error-code">{code}<' in answer.text
    assert "Traceback" not in answer.text


@pytest.mark.parametrize(("action", "body", "status", "code"), [
    ("cancel", {"id": "order-42"}, 400, "invalid-argument"),
    ("cancel", {"id": "order-42", "reason": "   "}, 400, "reason-required"),
    ("cancel", {"id": "", "reason": "r"}, 400, "invalid-id"),
    ("cancel", {"id": "a\nb", "reason": "r"}, 400, "invalid-id"),
    ("cancel", {"id": "x" * 600, "reason": "r"}, 400, "invalid-argument"),
    ("reschedule", {"id": "order-42", "reason": "r"}, 400, "invalid-time"),
    ("reschedule", {"id": "order-42", "reason": "r", "due": "later"}, 400, "invalid-time"),
    ("reschedule", {"id": "order-9", "reason": "r", "due": "2030-01-01T00:00Z"}, 409,
     "not-pending"),
    ("deliver-now", {"id": "order-9", "reason": "r"}, 409, "not-pending"),
    ("explode", {"id": "order-42", "reason": "r"}, 400, "invalid-action"),
])
def test_bad_actions_answer_with_a_code_and_write_nothing(
        action: str, body: dict[str, str], status: int, code: str) -> None:
    app, _, actions = console_app(Policy())
    web = client(app)
    answer = web.post(f"/api/v1/actions/{action}", headers=_session(web), json=body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
    assert actions.done == []


def test_a_malformed_json_body_is_400() -> None:
    app, _, _ = console_app(Policy())
    web = client(app)
    answer = web.post("/api/v1/actions/cancel", content=b"{not json",
                      headers={**_session(web), "content-type": "application/json"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "invalid-argument")


def test_a_past_reschedule_time_reaches_the_actions_unchanged_for_them_to_clamp() -> None:
    app, _, actions = console_app(Policy())
    web = client(app)
    answer = web.post("/api/v1/actions/reschedule", headers=_session(web),
                      json={"id": "order-42", "reason": "r", "due": "2001-01-01T00:00Z"})
    assert answer.status_code == 200
    assert actions.done[0].due_ms == 978_307_200_000


def test_kafka_failures_answer_503_and_surprises_500_without_a_traceback() -> None:
    app, reads, _ = console_app(Policy())
    web = client(app)
    reads.fail_with = KafkaException(KafkaError(KafkaError._TRANSPORT, "broker gone"))
    answer = web.get("/api/v1/overview")
    assert (answer.status_code, answer.json()["error"]["code"]) == (503, "kafka")
    reads.fail_with = RuntimeError("secret internals")
    for path in ("/api/v1/overview", "/"):
        answer = web.get(path)
        assert answer.status_code == 500
        assert "internal" in answer.text
        assert "secret internals" not in answer.text
        assert "Traceback" not in answer.text


def test_unknown_paths_are_404_with_a_code() -> None:
    app, _, _ = console_app(Policy())
    answer = client(app).get("/api/v1/nothing")
    assert (answer.status_code, answer.json()["error"]["code"]) == (404, "not-found")


def test_the_openapi_schema_lists_the_api() -> None:
    app, _, _ = console_app(Policy())
    schema = client(app).get("/api/v1/openapi.json").json()
    paths = set(schema["paths"])
    assert {"/api/v1/session", "/api/v1/overview", "/api/v1/schedules",
            "/api/v1/schedules/{reference}", "/api/v1/timeline",
            "/api/v1/actions/{action}", "/api/v1/retention", "/api/v1/bulk/{action}"} <= paths
    assert not any(path in paths for path in ("/", "/pending", "/record/{action}"))


def test_every_page_renders() -> None:
    app, _, _ = console_app(Policy())
    web = client(app)
    assert web.get("/api/v1/retention").json()["recommended_retention_ms"] == 7_200_000
    for path in ("/", "/pending", "/timeline?bucket=1m", "/record", "/record?ref=order-42",
                 "/retention",
                 "/static/htmx-2.0.8.min.js", "/static/htmx-LICENSE.txt"):
        assert web.get(path).status_code == 200, path


def test_the_list_sorts_by_each_column_either_way_and_filters_by_key() -> None:
    app, reads, _ = console_app(Policy())
    web = client(app)
    answer = web.get("/api/v1/schedules", params={"sort": "target", "order": "desc",
                                                   "key": "customer-7", "limit": 10})
    assert answer.status_code == 200
    assert (answer.json()["sort"], answer.json()["order"]) == ("target", "desc")
    assert (answer.json()["capped"], answer.json()["of"]) == (KEY_SCAN, 20_000)
    _, _, limit, order, key = reads.listed[-1]
    assert (limit, order, key) == (10, Order("target", True), KeyMatch(b"customer-7"))
    web.get("/api/v1/schedules", params={"key_prefix": "cust"})
    assert reads.listed[-1][3:] == (DUE, KeyMatch(b"cust", prefix=True))
    page = web.get("/pending", params={"sort": "id", "key": "customer-7"}).text
    assert 'data-sort="id" data-order="asc"' in page
    assert "sort=id&amp;order=desc" in page  # the current column's header turns it around
    assert "sort=target&amp;order=asc" in page
    assert "among the first 10000 of 20000" in page
    assert 'id="bulk-no-key"' in page
    assert 'id="bulk-form"' not in page


@pytest.mark.parametrize(("params", "code"), [
    ({"sort": "size"}, "invalid-sort"), ({"order": "up"}, "invalid-sort"),
    ({"key": "a", "key_prefix": "b"}, "invalid-filter"), ({"key": "k" * 1_025}, "invalid-filter"),
    ({"sort": "request", "skip": 9_990, "limit": 20}, "invalid-page"),
])
def test_a_bad_sort_or_key_answers_400_with_its_code(params: dict[str, Any], code: str) -> None:
    app, _, _ = console_app(Policy())
    web = client(app)
    for path in ("/api/v1/schedules", "/pending"):
        answer = web.get(path, params=params)
        assert answer.status_code == 400, path
        assert code in answer.text
