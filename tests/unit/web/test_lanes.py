"""Lanes in the console: an id is unique within its lane, so every action names one.

No broker: the app's reads and actions are stand-ins (``fakes.py``); the
real-broker proof is tests/browser/test_lanes.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from kdelay.web.access import Policy
from tests.unit.web.fakes import FakeActions, FakeReads, client, console_app


def _web() -> tuple[Any, FakeReads, FakeActions, dict[str, str]]:
    app, reads, actions = console_app(Policy())
    reads.lane_ids = {("order-42", "dev1"), ("order-7", "dev1"), ("order-7", "dev2")}
    web = client(app)
    token = {"X-CSRF-Token": web.get("/api/v1/session").json()["csrf_token"]}
    return web, reads, actions, token


@pytest.mark.parametrize("action", ["cancel", "reschedule", "deliver-now"])
def test_an_api_action_names_the_lane_it_was_given(action: str) -> None:
    web, _, actions, token = _web()
    body = {"id": "order-7", "lane": "dev2", "reason": "wrong lane", "due": "2030-01-01T00:00Z"}
    answer = web.post(f"/api/v1/actions/{action}", headers=token, json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["lane"] == "dev2"
    assert [(d.schedule_id, d.lane) for d in actions.done] == [("order-7", "dev2")]


def test_an_action_without_a_lane_names_none() -> None:
    web, _, actions, token = _web()
    answer = web.post("/api/v1/actions/cancel", headers=token,
                      json={"id": "order-42", "reason": "r"})
    assert answer.status_code == 200
    assert [(d.schedule_id, d.lane) for d in actions.done] == [("order-42", None)]


def test_a_reschedule_is_checked_against_the_lane_it_names() -> None:
    web, _, actions, token = _web()
    body = {"id": "order-7", "reason": "r", "due": "2030-01-01T00:00Z"}
    answer = web.post("/api/v1/actions/reschedule", headers=token, json=body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (409, "not-pending")
    answer = web.post("/api/v1/actions/reschedule", headers=token,
                      json={**body, "lane": "dev3"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (409, "not-pending")
    assert "in lane dev3" in answer.json()["error"]["message"]
    assert actions.done == []


@pytest.mark.parametrize("lane", ["-dev", "dev/1", "x" * 65, "dév"])
def test_a_bad_lane_is_refused_before_anything_is_written(lane: str) -> None:
    web, _, actions, token = _web()
    answer = web.post("/api/v1/actions/cancel", headers=token,
                      json={"id": "order-7", "lane": lane, "reason": "r"})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] in ("invalid-lane", "invalid-argument")
    assert actions.done == []


def test_a_bad_lane_has_its_own_code() -> None:
    web, _, _, token = _web()
    answer = web.post("/api/v1/actions/cancel", headers=token,
                      json={"id": "order-7", "lane": "dev/1", "reason": "r"})
    assert answer.json()["error"]["code"] == "invalid-lane"
    assert web.get("/api/v1/schedules/order-7?lane=dev/1").json()["error"]["code"] \
        == "invalid-lane"
    assert web.get("/record?ref=order-7&lane=-x").status_code == 400


def test_the_record_form_carries_its_lane() -> None:
    web, _, actions, token = _web()
    answer = web.post("/record/cancel", data={"id": "order-7", "lane": "dev1", "reason": "r",
                                              "csrf": token["X-CSRF-Token"]})
    assert answer.status_code == 200
    assert [(d.schedule_id, d.lane) for d in actions.done] == [("order-7", "dev1")]


def test_an_empty_lane_field_means_no_lane() -> None:
    web, _, actions, token = _web()
    web.post("/record/cancel", data={"id": "order-42", "lane": "", "reason": "r",
                                     "csrf": token["X-CSRF-Token"]})
    assert [(d.schedule_id, d.lane) for d in actions.done] == [("order-42", None)]


def test_a_record_lookup_takes_the_lane_of_the_query() -> None:
    web, reads, _, _ = _web()
    web.get("/api/v1/schedules/order-7?lane=dev1")
    web.get("/api/v1/schedules/order-7")
    web.get("/record?ref=order-7&lane=dev2")
    assert reads.lanes_asked == ["dev1", None, "dev2"]


def test_a_bulk_action_acts_on_each_schedule_in_its_own_lane() -> None:
    web, _, actions, token = _web()
    body = {"reason": "clean up", "id_prefix": "order-7"}
    dry = web.post("/api/v1/bulk/cancel", headers=token, json=body).json()
    assert dry["matched"] == 2
    web.post("/api/v1/bulk/cancel", headers=token, json={**body, "expect": 2})
    assert sorted((d.schedule_id, d.lane) for d in actions.done) == [
        ("order-7", "dev1"), ("order-7", "dev2")]
