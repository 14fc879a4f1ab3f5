"""The console with lanes, against the real broker: ``kdelay run --lanes`` as a process,
the console's app (real reads and actions) through a TestClient.

An id is unique within its lane: the same id in dev1 and dev2 is two schedules,
and an action names the lane of the one it means.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Settings
from kdelay.web.access import Gate, Policy
from kdelay.web.actions import Actions
from kdelay.web.app import create_app
from kdelay.web.console import Console
from kdelay.web.reads import Reads
from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess

kafka = pytest.mark.kafka
VIEW_S = 30.0


@pytest.fixture
def laned(deploy: Callable[..., Deployment], start_kdelay: Callable[..., KdelayProcess],
          topic_factory: TopicFactory, tmp_path: Path) -> Iterator[tuple[TestClient, str, str]]:
    """A deployment run with lanes dev1 and dev2, its console app, and a target per lane."""
    run = uuid.uuid4().hex[:8]
    first, second = f"dev1-{run}.", f"dev2-{run}."
    lanes = f"dev1={first},dev2={second}"
    deployment = deploy(partitions=2)
    one, two = topic_factory(f"{first}orders", 1), topic_factory(f"{second}orders", 1)
    audit = topic_factory("web-audit", 2)
    start_kdelay(deployment, KDELAY_LANES=lanes).wait_ready()
    settings = Settings(
        bootstrap_servers=deployment.bootstrap, requests_topic=deployment.requests,
        changelog_topic=deployment.changelog, dlq_topic=deployment.dlq,
        outcomes_topic=deployment.outcomes, group_id=deployment.group_id,
        state_dir=deployment.state_dir, lanes=lanes)  # type: ignore[arg-type]
    clock = SystemClock()
    actions = Actions(settings, clock, audit_topic=audit)
    console = Console(Gate(Policy(), key=b"k" * 32),
                      Reads(settings, tmp_path / "view", clock, audit_topic=audit),
                      actions, clock)
    web = TestClient(create_app(console), base_url="http://127.0.0.1:8080",
                     raise_server_exceptions=False)
    try:
        yield web, one, two
    finally:
        actions.close()


def _lanes_pending(web: TestClient, token: dict[str, str], prefix: str) -> dict[str, int]:
    """How many schedules with ids starting ``prefix`` each lane holds, as the view sees."""
    answer = web.get("/api/v1/schedules", params={"id_prefix": prefix})
    assert answer.status_code == 200, answer.text
    counts: dict[str, int] = {}
    for item in answer.json()["items"]:
        counts[item["lane"]] = counts.get(item["lane"], 0) + 1
    return counts


def _until(check: Callable[[], Any], expected: Any) -> Any:
    """Poll ``check`` until it answers ``expected`` (the view reads the changelog, which
    the service writes alongside the outcome) or :data:`VIEW_S` pass; its last answer."""
    deadline = time.monotonic() + VIEW_S
    while (found := check()) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


@kafka
def test_a_console_cancel_with_a_lane_cancels_only_that_lanes_schedule(
        laned: tuple[TestClient, str, str]) -> None:
    web, one, two = laned
    token = {"X-CSRF-Token": web.get("/api/v1/session").json()["csrf_token"]}
    for lane, target in (("dev1", one), ("dev2", two)):
        for schedule_id in ("twin", "pair"):
            made = web.post("/api/v1/schedules", headers=token, json={
                "target": target, "value": "v", "id": schedule_id, "lane": lane,
                "delay": "2h", "reason": "set up"})
            assert made.status_code == 200, made.text
            assert made.json()["outcome"] == "scheduled"
    both = {"dev1": 1, "dev2": 1}
    assert _until(lambda: _lanes_pending(web, token, "twin"), both) == both

    without = web.post("/api/v1/actions/cancel", headers=token,
                       json={"id": "twin", "reason": "no lane"})
    assert without.json()["outcome"] == "unknown"  # no schedule of no lane holds it
    cancelled = web.post("/api/v1/actions/cancel", headers=token,
                         json={"id": "twin", "lane": "dev1", "reason": "dev1 only"})
    assert cancelled.status_code == 200, cancelled.text
    assert (cancelled.json()["outcome"], cancelled.json()["lane"]) == ("cancelled", "dev1")
    left = {"dev2": 1}
    assert _until(lambda: _lanes_pending(web, token, "twin"), left) == left

    shown = web.get("/api/v1/schedules/twin").json()  # no lane: the first lane holding it
    assert (shown["status"], shown["lane"]) == ("pending", "dev2")
    assert "cancelled" not in [step["what"] for step in shown["trace"]]
    gone = web.get("/api/v1/schedules/twin", params={"lane": "dev1"}).json()
    assert gone["lane"] is None
    assert "cancelled" in [step["what"] for step in gone["trace"]]
    assert any(step["what"] == "console cancel" and "dev1 only" in step["detail"]
               for step in gone["trace"])
    page = web.get("/record", params={"ref": "twin"}).text
    assert '<input type="hidden" name="lane" value="dev2">' in page

    later = web.post("/api/v1/actions/reschedule", headers=token,
                     json={"id": "twin", "lane": "dev2", "reason": "later",
                           "due": str(int(time.time() * 1000) + 3 * 3_600_000)})
    assert later.json()["outcome"] == "rescheduled"

    body = {"reason": "both lanes", "id_prefix": "pair"}
    assert web.post("/api/v1/bulk/cancel", headers=token, json=body).json()["matched"] == 2
    bulk = web.post("/api/v1/bulk/cancel", headers=token, json={**body, "expect": 2})
    assert bulk.json()["outcomes"] == {"cancelled": 2}, bulk.text
