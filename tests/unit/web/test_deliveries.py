"""The deliveries, lateness and series-run screens and their API twins, without Kafka.

The reads are stand-ins (``fakes.py``); what they read from the broker is in
``tests/integration/test_console_deliveries.py`` and the browser tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Settings
from kdelay.view import tails
from kdelay.web.access import Policy
from kdelay.web.problems import Problem
from kdelay.web.reads import Reads
from tests.unit.web.fakes import NOW_MS, basic, client, console_app, users_policy


def test_the_api_lists_deliveries_with_target_offset_id_and_lateness() -> None:
    app, reads, _ = console_app(Policy())
    web = client(app)
    found = web.get("/api/v1/deliveries").json()
    first = found["items"][0]
    assert (first["target"], first["partition"], first["offset"], first["schedule_id"],
            first["lateness_ms"], first["origin"]) == (
        "orders", 1, 17, "order-7", 180, "kdelay.requests/0/5")
    assert found["capped"] == ["orders"]
    only = web.get("/api/v1/deliveries", params={"target": "mail", "limit": 1}).json()
    assert [item["target"] for item in only["items"]] == ["mail"]
    assert reads.targets_asked == [None, "mail"]


def test_the_api_sums_lateness_per_target_over_the_window_asked() -> None:
    app, reads, _ = console_app(Policy())
    found = client(app).get("/api/v1/lateness", params={"window": "15m"}).json()
    assert reads.windows_asked == [900_000]
    rows = {row["target"]: row for row in found["targets"]}
    assert (rows["orders"]["p50_ms"], rows["orders"]["max_ms"], rows["orders"]["early"]) == (
        180, 180, 0)
    assert found["edges_ms"][0] == 0
    assert len(rows["mail"]["bins"]) == len(found["edges_ms"])
    hours = {(row["target"], row["hour_ms"]) for row in found["hours"]}
    assert hours == {("orders", 1_794_999_600_000), ("mail", 1_794_999_600_000)}


def test_bad_windows_targets_and_limits_answer_400_with_a_code() -> None:
    app, _, _ = console_app(Policy())
    web = client(app)
    for path, params, code in [
        ("/api/v1/lateness", {"window": "soon"}, "invalid-window"),
        ("/api/v1/lateness", {"window": "30d"}, "invalid-window"),
        ("/api/v1/lateness", {"window": "10ms"}, "invalid-window"),
        ("/api/v1/lateness", {"target": "no/such"}, "invalid-target"),
        ("/api/v1/deliveries", {"target": "a b"}, "invalid-target"),
        ("/api/v1/deliveries", {"limit": "0"}, "invalid-page"),
        ("/lateness", {"window": "soon"}, "invalid-window"),
    ]:
        answer = web.get(path, params=params)
        assert answer.status_code == 400, (path, params)
        if path.startswith("/api/"):
            assert answer.json()["error"]["code"] == code
        else:
            assert code in answer.text


def test_a_viewer_reads_the_delivery_screens_and_a_stranger_does_not() -> None:
    app, _, _ = console_app(users_policy())
    web = client(app)
    for path in ("/api/v1/deliveries", "/api/v1/lateness", "/deliveries", "/lateness"):
        assert web.get(path, headers=basic("vera")).status_code == 200, path
        assert web.get(path).status_code == 401, path


def test_the_pages_show_deliveries_lateness_and_series_runs() -> None:
    app, _, _ = console_app(Policy())
    web = client(app)
    history = web.get("/deliveries").text
    assert 'data-id="order-7"' in history
    assert 'data-offset="17"' in history
    assert "180 ms" in history
    assert "/record?ref=order-7" in history
    late = web.get("/lateness", params={"window": "1h"}).text
    assert 'data-target="orders" data-count="1" data-early="0"' in late
    assert 'data-hour-ms="1794999600000" data-target="mail" data-count="1"' in late
    runs = web.get("/series").text
    assert 'data-n="2" data-lateness-ms="120"' in runs
    series = web.get("/api/v1/series").json()["items"][0]
    assert [run["n"] for run in series["runs"]] == [2, 1]


def test_the_schema_names_the_delivery_endpoints() -> None:
    app, _, _ = console_app(Policy())
    paths = client(app).get("/api/v1/openapi.json").json()["paths"]
    assert {"/api/v1/deliveries", "/api/v1/lateness"} <= set(paths)


def test_the_delivery_screens_need_no_summary_while_it_is_first_read(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Before the first summary the pending targets are unknown: the newest requests
    still name targets, and the screens answer instead of 503 ``view-loading``."""

    class Loading:
        def summary(self) -> None:
            raise Problem(503, "view-loading", "still reading")

    reads = Reads(Settings(), tmp_path, ManualClock(NOW_MS), audit_topic="audit")
    reads._snapshots = Loading()  # type: ignore[assignment]
    monkeypatch.setattr(tails, "newest", lambda *_, **__: tails.Tail(["orders", None]))
    assert reads.delivery_targets() == ["kdelay.series", "kdelay.tasks", "orders"]
