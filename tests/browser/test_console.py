"""The console in a real browser, against the real broker and a running service.

A person's paths, clicked in Chromium: find a schedule by id and open it;
cancel one with a reason (the page shows ``cancelled``, and a later record
on the same target arrives while the cancelled one never does); reschedule
one to a past time (it is delivered at once, at the new due time); a bulk
cancel acts on the count its dry run showed; a viewer is refused every
action; a form without its CSRF token fails; bad input answers 400 with its
code; the timeline's counts are ``kdelay backlog``'s; the pending list sorts by
each column either way and filters by record key; the overview shows each
partition serving, as its instance's status record says.

The service runs on the system clock: a test polls for what it expects,
within a bounded deadline, and never sleeps for a due time.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from kdelay import controls, recurring
from kdelay.client import DelayProducer
from kdelay.plumbing.settings import Settings
from kdelay.protocol.controls import Control, Scope, Subject
from tests.browser.conftest import OPERATOR, VIEWER, Stack, cli_env
from tests.e2e.conftest import Receiver, kdelay_command, run_cli

pytestmark = [pytest.mark.kafka, pytest.mark.browser]
SEEN_S = 60.0
HOUR = dt.timedelta(hours=1)
ACTIONS = [("cancel", {}), ("reschedule", {"due": "2030-01-01T00:00:00Z"}), ("deliver-now", {})]


@pytest.fixture(scope="module")
def producer(stack: Stack) -> Iterator[DelayProducer]:
    """The client library on the stack's deployment, as any producer uses it."""
    with DelayProducer(_settings(stack)) as made:
        yield made


def _settings(stack: Stack) -> Settings:
    """The client settings of the stack's deployment."""
    d = stack.deployment
    return Settings(bootstrap_servers=d.bootstrap, requests_topic=d.requests,
                    changelog_topic=d.changelog, dlq_topic=d.dlq, outcomes_topic=d.outcomes)


@pytest.fixture
def page_of(browser: Any) -> Iterator[Callable[..., Any]]:
    """New pages of the shared browser, in contexts closed when the test ends."""
    contexts: list[Any] = []

    def make(credentials: tuple[str, str] | None = None) -> Any:
        http = None if credentials is None else {"username": credentials[0],
                                                 "password": credentials[1]}
        context = browser.new_context(viewport={"width": 1200, "height": 800},
                                      http_credentials=http)
        contexts.append(context)
        return context.new_page()

    yield make
    for context in contexts:
        context.close()


@pytest.fixture
def received(stack: Stack, admin: AdminClient) -> Iterator[Receiver]:
    """A reader of the stack's target topic from its beginning."""
    reader = Receiver(stack.deployment.bootstrap, admin, [stack.target])
    yield reader
    reader.close()


def open_pending(page: Any, url: str, schedule_id: str) -> None:
    """Open the record page of ``schedule_id``, reloading until the view holds it as pending."""
    deadline = time.monotonic() + SEEN_S
    while True:
        page.goto(f"{url}/record?ref={schedule_id}")
        if page.text_content("#status") == "pending":
            return
        assert time.monotonic() < deadline, f"{schedule_id} not pending in the console"
        time.sleep(0.3)


def wait_for_counts_after(page: Any, url: str, since_ms: int) -> None:
    """Wait until the console counts from a summary taken after ``since_ms`` (the screens
    that count, overview and timeline, read a summary a background thread refreshes)."""
    deadline = time.monotonic() + SEEN_S
    while True:
        page.goto(url + "/api/v1/timeline?bucket=1h")
        as_of = json.loads(page.text_content("body") or "{}").get("as_of_ms")
        if as_of is not None and as_of > since_ms:
            return
        assert time.monotonic() < deadline, f"no summary after {since_ms} (as of {as_of})"
        time.sleep(0.5)


def keys(reader: Receiver) -> list[bytes | None]:
    return [r.message.key() for r in reader.received]


def test_find_a_schedule_by_id_then_cancel_another_with_a_reason(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any],
        received: Receiver, shots: Path) -> None:
    producer.send(stack.target, '{"id": 42}', key="order-42", delay=HOUR, id="order-42")
    due_43 = int(time.time() * 1000) + 30_000
    producer.send(stack.target, '{"id": 43}', key="order-43", due=due_43, id="order-43")
    page = page_of()
    page.goto(stack.open.url + "/")
    page.fill("header input[name=ref]", "order-42")
    page.click("header button[type=submit]")
    page.wait_for_url("**/record?ref=order-42")
    open_pending(page, stack.open.url, "order-42")
    assert page.text_content("#target") == stack.target
    assert '"id": 42' in page.text_content("#payload")
    page.screenshot(path=shots / "record.png", full_page=True)

    open_pending(page, stack.open.url, "order-43")
    page.fill("#cancel-form input[name=reason]", "customer asked on the phone")
    page.click("#cancel-form button")
    page.wait_for_selector("#outcome-value")
    assert page.text_content("#outcome-value") == "cancelled"
    page.screenshot(path=shots / "cancelled.png", full_page=True)
    assert "console cancel" in page.text_content("#trace")
    assert "customer asked on the phone" in page.text_content("#trace")

    # A later record on the same target comes through; the cancelled one never does.
    producer.send(stack.target, "after", key="after-43", due=due_43 + 2_000, id="after-43")
    received.until(lambda: b"after-43" in keys(received), "the record due after order-43")
    assert b"order-43" not in keys(received)
    assert b"order-42" not in keys(received)


def test_reschedule_to_a_past_time_delivers_it_now(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any],
        received: Receiver) -> None:
    producer.send(stack.target, '{"id": 44}', key="order-44", delay=HOUR, id="order-44")
    page = page_of()
    open_pending(page, stack.open.url, "order-44")
    past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    page.fill("#reschedule-form input[name=due]", past.strftime("%Y-%m-%dT%H:%M"))
    page.fill("#reschedule-form input[name=reason]", "the customer wants it today")
    before_ms = int(time.time() * 1000)
    page.click("#reschedule-form button")
    page.wait_for_selector("#outcome-value")
    assert page.text_content("#outcome-value") == "rescheduled"
    received.until(lambda: b"order-44" in keys(received), "order-44, rescheduled to now")
    record = next(r.message for r in received.received if r.message.key() == b"order-44")
    raw_due = dict(record.headers() or [])["kdelay-due-ms"]
    assert isinstance(raw_due, bytes)
    due_ms = int(raw_due)
    assert before_ms - 1_000 <= due_ms <= int(time.time() * 1000)
    assert record.value() == b'{"id": 44}'


def test_a_viewer_gets_403_on_every_action(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any], shots: Path) -> None:
    producer.send(stack.target, '{"id": 45}', key="order-45", delay=HOUR, id="order-45")
    page = page_of(VIEWER)
    open_pending(page, stack.users.url, "order-45")
    assert page.query_selector("#cancel-form") is None
    assert page.is_visible("#viewer-note")
    assert page.is_visible("#payload-hidden")
    assert "vera · viewer" in page.text_content("header .who")
    page.screenshot(path=shots / "viewer.png", full_page=True)
    token = page.request.get(stack.users.url + "/api/v1/session").json()["csrf_token"]
    for action, extra in ACTIONS:
        body = {"id": "order-45", "reason": "a viewer tries", **extra}
        api = page.request.post(f"{stack.users.url}/api/v1/actions/{action}", data=body,
                                headers={"X-CSRF-Token": token})
        assert (api.status, api.json()["error"]["code"]) == (403, "forbidden")
        form = page.request.post(f"{stack.users.url}/record/{action}",
                                 form={**body, "csrf": token})
        assert form.status == 403
        assert 'id="error-code">forbidden<' in form.text()
    open_pending(page, stack.users.url, "order-45")
    assert "console" not in page.text_content("#trace")


def test_a_form_posted_without_its_csrf_token_fails(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any]) -> None:
    producer.send(stack.target, '{"id": 46}', key="order-46", delay=HOUR, id="order-46")
    page = page_of(OPERATOR)
    open_pending(page, stack.users.url, "order-46")
    page.evaluate("document.querySelector('#cancel-form input[name=csrf]').remove()")
    page.fill("#cancel-form input[name=reason]", "no token")
    page.click("#cancel-form button")
    page.wait_for_selector("#error-code")
    assert page.text_content("#error-code") == "csrf-failed"
    bare = page.request.post(f"{stack.users.url}/record/cancel",
                             form={"id": "order-46", "reason": "no token"})
    assert bare.status == 403
    open_pending(page, stack.users.url, "order-46")  # still pending: nothing was written


def test_bad_input_answers_400_with_its_code(stack: Stack, page_of: Callable[..., Any],
                                             shots: Path) -> None:
    page = page_of()
    answer = page.goto(stack.open.url + "/pending?due_from=someday")
    assert answer.status == 400
    assert page.text_content("#error-code") == "invalid-time"
    page.screenshot(path=shots / "error.png")
    token = page.request.get(stack.open.url + "/api/v1/session").json()["csrf_token"]
    bad = page.request.post(stack.open.url + "/api/v1/actions/reschedule",
                            data={"id": "order-42", "reason": "r", "due": "soon"},
                            headers={"X-CSRF-Token": token})
    assert (bad.status, bad.json()["error"]["code"]) == (400, "invalid-time")
    assert page.goto(stack.open.url + "/timeline?bucket=2h").status == 400


def test_a_script_schedules_over_http_and_a_repeat_is_a_duplicate(
        stack: Stack, page_of: Callable[..., Any]) -> None:
    page = page_of(OPERATOR)
    url = stack.users.url
    token = page.request.get(url + "/api/v1/session").json()["csrf_token"]
    body = {"target": stack.target, "value": '{"id": 47}', "key": "order-47", "id": "order-47",
            "delay": "1h", "reason": "scheduled by a script", "headers": {"source": "api"}}
    first = page.request.post(url + "/api/v1/schedules", data=body,
                              headers={"X-CSRF-Token": token})
    assert (first.status, first.json()["outcome"]) == (200, "scheduled")
    again = page.request.post(url + "/api/v1/schedules", data=body,
                              headers={"X-CSRF-Token": token})
    assert (again.status, again.json()["outcome"]) == (200, "duplicate")
    open_pending(page, url, "order-47")
    assert "source" in page.text_content("#headers")
    assert "console schedule" in page.text_content("#trace")


def test_a_bulk_cancel_acts_on_the_count_its_dry_run_showed(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any], shots: Path) -> None:
    for i in range(6):
        producer.send(stack.target, f"bulk {i}", key=f"bulk-{i}", delay=HOUR, id=f"bulk-{i}")
    page = page_of()
    deadline = time.monotonic() + SEEN_S
    while True:
        page.goto(stack.open.url + "/pending?id_prefix=bulk-")
        if page.text_content("#total").startswith("6 matches"):
            break
        assert time.monotonic() < deadline, page.text_content("#total")
        time.sleep(0.3)
    page.fill("#bulk-form input[name=reason]", "campaign withdrawn")
    page.click("#bulk-form button")
    page.wait_for_selector("#bulk-count")
    counted = int(page.text_content("#bulk-count") or "")
    assert counted == 6
    assert page.text_content("#bulk-confirm button").startswith("Cancel 6 schedules")
    page.screenshot(path=shots / "bulk.png", full_page=True)
    page.click("#bulk-confirm button")
    page.wait_for_selector("#bulk-done")
    assert page.text_content("#bulk-acted") == str(counted)
    outcomes = page.eval_on_selector_all(
        ".bulk-outcome", "spans => spans.map(s => [s.dataset.outcome, s.textContent])")
    assert outcomes == [["cancelled", "cancelled 6"]]
    deadline = time.monotonic() + SEEN_S
    while not page.text_content("#total").startswith("0 matches"):
        assert time.monotonic() < deadline, page.text_content("#total")
        page.goto(stack.open.url + "/pending?id_prefix=bulk-")


def test_the_timeline_counts_what_kdelay_backlog_counts(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any], shots: Path) -> None:
    start_ms = int(time.time() * 1000) + 2 * 3_600_000
    other = stack.target + "-b"
    for i in range(12):
        producer.send(stack.target, f"load {i}", due=start_ms + i * 37_000, id=f"load-{i}")
    for i in range(5):
        producer.send(other, f"other {i}", due=start_ms + i * 61_000, id=f"other-{i}")
    page = page_of()
    for prefix, count in (("load-", 12), ("other-", 5)):
        deadline = time.monotonic() + SEEN_S
        while True:  # until the view holds them all; then nothing changes until the end
            page.goto(f"{stack.open.url}/pending?id_prefix={prefix}")
            if page.text_content("#total").startswith(f"{count} matches"):
                break
            assert time.monotonic() < deadline, page.text_content("#total")
            time.sleep(0.3)
    wait_for_counts_after(page, stack.open.url, int(time.time() * 1000))
    page.goto(stack.open.url + "/timeline?bucket=1m")
    rows = page.eval_on_selector_all(
        "#timeline tr[data-start]",
        "rows => rows.map(r => [r.dataset.start, r.children[2].textContent])")
    page.screenshot(path=shots / "timeline.png", full_page=True)
    shown = {int(start): int(count) for start, count in rows}
    backlog = run_cli(cli_env(stack), "backlog", "--bucket", "1m", "--by", "target", "--json")
    assert backlog.returncode == 0, backlog.stderr
    counted = json.loads(backlog.stdout)
    assert shown == {b["start_ms"]: b["count"] for b in counted["buckets"]}
    targets = page.eval_on_selector_all(
        "#timeline tr:first-child th.num", "cells => cells.map(c => c.textContent)")[1:]
    cells = page.eval_on_selector_all(
        "#timeline tr[data-start]",
        "rows => rows.map(r => Array.from(r.children).slice(3, -1).map(c => c.textContent))")
    sums = {target: sum(int(row[i]) for row in cells) for i, target in enumerate(targets)}
    assert sums == counted["by_target"]

    page.goto(stack.open.url + "/")
    assert int(page.text_content("#pending-total") or "") == counted["pending"]
    assert page.eval_on_selector_all("#instances td.partitions",
                                     "cells => cells.map(c => c.textContent)") == ["0, 1"]
    # Each partition's index, as the service's status record says (written on change,
    # at most every 2 s): both serve, and the page says how fresh that is.
    deadline = time.monotonic() + 30
    while (states := page.eval_on_selector_all(
            "#lag tr[data-partition]", "rows => rows.map(r => r.dataset.state)")) != [
            "serving", "serving"] and time.monotonic() < deadline:
        time.sleep(1)
        page.goto(stack.open.url + "/")
    assert states == ["serving", "serving"]
    assert all(" ago" in said for said in page.eval_on_selector_all(
        "#lag tr[data-partition] td.said", "cells => cells.map(c => c.textContent)"))
    page.screenshot(path=shots / "overview.png", full_page=True)
    page.goto(stack.open.url + "/retention")
    checked = run_cli(cli_env(stack), "retention", "check", "--json")
    assert checked.returncode in (0, 3), checked.stderr
    assert int(page.text_content("#at-risk") or "") == json.loads(checked.stdout)["at_risk"]
    named = [r["offset"] for r in json.loads(checked.stdout)["at_risk_records"]]
    assert len(page.query_selector_all("#at-risk-records tr[data-why]")) == len(named)
    page.screenshot(path=shots / "retention.png", full_page=True)
    page.goto(stack.open.url + "/pending?id_prefix=load-&limit=5")
    assert page.text_content("#total").startswith("12 matches")
    assert len(page.query_selector_all("#pending tr")) == 6  # the head row and 5
    page.screenshot(path=shots / "pending.png", full_page=True)


def _rows(page: Any) -> list[dict[str, Any]]:
    """The pending list's rows: id, due, target, key and the request's coordinates."""
    found: list[dict[str, Any]] = page.eval_on_selector_all(
        "#pending tr[data-due]", """rows => rows.map(r => ({
            id: r.children[0].textContent.trim(), due: Number(r.dataset.due),
            target: r.children[3].textContent, key: r.children[5].textContent,
            request: [Number(r.dataset.partition), Number(r.dataset.offset)]}))""")
    return found


def _sort_by(page: Any, column: str) -> None:
    """Click the pending list's ``column`` header and wait for the page it opens."""
    link = f"#pending a.sort[data-sort={column}]"
    href = page.get_attribute(link, "href") or ""
    page.click(link)
    page.wait_for_url(lambda url: url.endswith(href))


def test_the_pending_list_sorts_by_each_column_and_filters_by_key(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any], shots: Path) -> None:
    start_ms = int(time.time() * 1000) + 5 * 3_600_000
    other = stack.target + "-s"
    order = [3, 0, 5, 1, 4, 2]  # due order differs from id, key and request order
    for i, place in enumerate(order):
        producer.send(stack.target if i % 2 else other, f"sort {i}",
                      key=f"sortkey-{'ba'[i % 2]}-{i}", due=start_ms + place * 60_000,
                      id=f"sort-{i}")
    page = page_of()
    deadline = time.monotonic() + SEEN_S
    while True:
        page.goto(stack.open.url + "/pending?id_prefix=sort-")
        if page.text_content("#total").startswith("6 matches"):
            break
        assert time.monotonic() < deadline, page.text_content("#total")
        time.sleep(0.3)
    ids = [f"sort-{i}" for i in range(6)]
    # Read from the copy (an id prefix): each header sorts by its column, a second click
    # turns it around.
    _sort_by(page, "id")
    assert page.get_attribute("#sorted", "data-order") == "asc"
    assert [row["id"] for row in _rows(page)] == ids
    _sort_by(page, "id")
    assert page.get_attribute("#sorted", "data-order") == "desc"
    assert [row["id"] for row in _rows(page)] == ids[::-1]
    _sort_by(page, "due")
    _sort_by(page, "due")
    dues = [row["due"] for row in _rows(page)]
    assert dues == sorted(dues, reverse=True), page.url
    # Counted from the summary: the six by their due window, by target, then by request.
    wait_for_counts_after(page, stack.open.url, int(time.time() * 1000))
    window = f"due_from={start_ms}&due_to={start_ms + 5 * 60_000}"
    page.goto(f"{stack.open.url}/pending?{window}&sort=target")
    shown = _rows(page)
    assert page.text_content("#total").startswith("6 matches")
    assert [(r["target"], r["due"]) for r in shown] == sorted((r["target"], r["due"])
                                                              for r in shown)
    assert [r["target"] for r in shown] == sorted([other] * 3 + [stack.target] * 3)
    page.screenshot(path=shots / "pending-sorted.png", full_page=True)
    page.goto(f"{stack.open.url}/pending?{window}&sort=request&order=desc")
    requests = [tuple(r["request"]) for r in _rows(page)]
    assert requests == sorted(requests, reverse=True)
    assert len(requests) == 6
    # The record key, exactly or by its prefix.
    page.goto(f"{stack.open.url}/pending?key=sortkey-a-1")
    assert page.text_content("#total").startswith("1 match")
    assert [r["id"] for r in _rows(page)] == ["sort-1"]
    page.goto(f"{stack.open.url}/pending?key_prefix=sortkey-b-&sort=id")
    assert page.text_content("#total").startswith("3 matches")
    assert [r["id"] for r in _rows(page)] == ["sort-0", "sort-2", "sort-4"]
    assert all(r["key"].startswith("sortkey-b-") for r in _rows(page))
    page.screenshot(path=shots / "pending-key.png", full_page=True)
    answer = page.goto(f"{stack.open.url}/api/v1/schedules?sort=size")
    assert answer.status == 400
    assert "invalid-sort" in (page.text_content("body") or "")


def test_a_dead_letter_is_sent_again_once_its_target_exists(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any],
        admin: AdminClient, shots: Path) -> None:
    """A record due now for a target topic that does not exist yet is retried for the
    service's retry window, then dead-lettered as ``undeliverable``. Once the topic is
    created, an operator sends the dead letter again from the console, with a reason:
    the outcome is ``scheduled`` and the record arrives on its target."""
    late = f"{stack.target}-late"
    producer.send(late, "late one", key="late-1", due=int(time.time() * 1000), id="late-1")
    page = page_of()
    row = "#dead-letters tr[data-id='late-1'][data-code='undeliverable']"
    deadline = time.monotonic() + SEEN_S
    while True:  # the service's retry window (3 s here), then the dead letter
        page.goto(stack.open.url + "/dead-letters?code=undeliverable")
        if page.query_selector(row) is not None:
            break
        assert time.monotonic() < deadline, "no undeliverable dead letter for late-1"
        time.sleep(0.5)
    assert "late-1" in page.text_content(row)
    page.screenshot(path=shots / "dead-letters.png", full_page=True)
    while True:  # the trace ends at the dead letter, with its code
        page.goto(stack.open.url + "/record?ref=late-1")
        if "undeliverable" in (page.text_content("#trace") or ""):
            break
        assert time.monotonic() < deadline, page.text_content("#trace")
        time.sleep(0.5)
    steps = page.eval_on_selector_all("#trace td.step", "cells => cells.map(c => c.textContent)")
    assert "dead-lettered" in steps
    page.goto(stack.open.url + "/dead-letters?code=undeliverable")
    admin.create_topics([NewTopic(late, num_partitions=1, replication_factor=1)])[late].result(
        timeout=30)
    reader = Receiver(stack.deployment.bootstrap, admin, [late])
    try:
        page.fill(f"{row} input[name=reason]", "the topic was created late")
        page.click(f"{row} button")
        page.wait_for_selector("#resent")
        assert page.text_content("#resent-outcome") == "scheduled"
        reader.until(lambda: b"late-1" in keys(reader), "late-1, sent again")
        record = next(r.message for r in reader.received if r.message.key() == b"late-1")
        assert record.value() == b"late one"
    finally:
        reader.close()
        admin.delete_topics([late])[late].result(timeout=30)


def test_a_same_second_burst_is_marked_on_the_timeline(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any],
        shots: Path) -> None:
    """A hundred records due in one second, an hour ahead: the timeline marks their bucket
    with that second and its count, as the API does."""
    second_ms = (int(time.time()) + 3_600) * 1_000
    for number in range(100):
        producer.send_async(stack.target, "spike", key=f"spike-{number}",
                            due=second_ms + number % 1_000, id=f"spike-{number}")
    producer.flush()
    page = page_of()
    burst = f"#timeline span.burst[data-second='{second_ms}']"
    deadline = time.monotonic() + SEEN_S
    while True:  # until the view holds all hundred
        page.goto(stack.open.url + "/timeline?bucket=1h")
        shown = page.query_selector(burst)
        if shown is not None and "burst: 100 due" in (shown.text_content() or ""):
            break
        assert time.monotonic() < deadline, page.text_content("#timeline")
        time.sleep(0.3)
    page.screenshot(path=shots / "timeline-burst.png", full_page=True)
    page.goto(stack.open.url + "/api/v1/timeline?bucket=1h")
    marked = json.loads(page.text_content("body") or "{}")["bursts"]
    assert {"bucket_ms": second_ms // 3_600_000 * 3_600_000, "second_ms": second_ms,
            "count": 100} in marked


def test_configured_headers_and_json_fields_are_redacted_even_for_an_operator(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any]) -> None:
    producer.send(stack.target, '{"id": 50, "card": "4111-1111", "items": [{"card": "55"}]}',
                  key="order-50", delay=HOUR, id="order-50", headers={"x-secret": "s3cr3t"})
    page = page_of(OPERATOR)
    open_pending(page, stack.users.url, "order-50")
    payload = page.text_content("#payload") or ""
    assert '"id": 50' in payload
    assert "4111" not in payload
    assert payload.count("***") == 2
    assert "s3cr3t" not in (page.content())
    page.goto(stack.users.url + "/api/v1/schedules/order-50")
    answer = json.loads(page.text_content("body") or "{}")
    assert {"name": "x-secret", "value": "***"} in answer["headers"]
    assert "4111" not in json.dumps(answer)


def test_a_recurring_series_shows_its_next_fire_times_and_is_ended_with_a_reason(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any],
        shots: Path) -> None:
    """A series every hour, its first occurrence an hour ahead (started as ``kdelay send
    --every 1h`` starts one): the page shows its rule and five fire times an hour apart;
    an operator ends it with a reason and the service answers ``cancelled``."""
    now_ms = int(time.time() * 1000)
    first_ms = now_ms + 3_600_000
    recurring.start(producer, stack.target, "report", recurring.every("1h", first_ms),
                    schedule_id="hourly-report", now_ms=now_ms)
    page = page_of()
    row = "#series tr[data-id='hourly-report']"
    deadline = time.monotonic() + SEEN_S
    while True:  # until the view holds the occurrence
        page.goto(stack.open.url + "/series")
        if page.query_selector(row) is not None:
            break
        assert time.monotonic() < deadline, page.text_content("#series")
        time.sleep(0.3)
    fires = page.eval_on_selector_all(f"{row} ol.fires li",
                                      "items => items.map(i => +i.dataset.ms)")
    assert fires == [first_ms + n * 3_600_000 for n in range(5)]
    assert "every 1h" in page.text_content(row)
    page.screenshot(path=shots / "series.png", full_page=True)
    page.fill(f"{row} input[name=reason]", "the report moved to the warehouse")
    page.click(f"{row} button")
    page.wait_for_selector("#series-done")
    assert page.text_content("#series-outcome") == "cancelled"


def test_an_operator_pauses_a_target_sees_what_it_holds_back_and_resumes_it(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any],
        admin: AdminClient, shots: Path) -> None:
    """Paused from the controls screen with a reason, a target's due records stay pending:
    the screen counts them as held back. Resumed from its row with a catch-up rate, they
    arrive. A viewer sees the screen and no form."""
    paused = f"{stack.target}-paused"
    admin.create_topics([NewTopic(paused, num_partitions=1, replication_factor=1)])[
        paused].result(timeout=30)
    reader = Receiver(stack.deployment.bootstrap, admin, [paused])
    page = page_of()
    row = f"#controls tr[data-name='{paused}']"
    try:
        page.goto(stack.open.url + "/controls")
        page.fill("#pause-form input[name=name]", paused)
        page.fill("#pause-form input[name=reason]", "its consumers are down, INC-7")
        page.click("#pause-form button")
        page.wait_for_selector("#control-changed")
        assert page.text_content("#control-state") == "paused"
        assert page.get_attribute(row, "data-paused") == "yes"
        assert "its consumers are down, INC-7" in page.text_content(row)
        page.goto(stack.open.url + "/api/v1/controls")
        listed = json.loads(page.text_content("body") or "{}")["items"]
        assert [item["paused_by"] for item in listed if item["name"] == paused] == ["local"]
        deadline = time.monotonic() + SEEN_S
        while f"target {paused} paused by local" not in stack.service.log():
            assert time.monotonic() < deadline, "the service did not apply the pause"
            time.sleep(0.2)
        since_ms = int(time.time() * 1000)
        for number in range(3):
            producer.send(paused, f"held {number}", key=f"held-{number}",
                          due=since_ms - 1_000, id=f"held-{number}")
        deadline = time.monotonic() + SEEN_S
        while True:  # until a summary after the sends counts them
            page.goto(stack.open.url + "/controls")
            if (page.text_content(f"{row} td.held") or "").strip() == "3":
                break
            assert time.monotonic() < deadline, page.text_content("#controls")
            time.sleep(0.5)
        assert keys(reader) == [], "nothing delivered while paused"
        page.screenshot(path=shots / "controls.png", full_page=True)
        viewer = page_of(VIEWER)
        viewer.goto(stack.users.url + "/controls")
        assert viewer.query_selector("#pause-form") is None
        assert paused in (viewer.text_content("#controls") or "")
        page.fill(f"{row} form.resume input[name=rate]", "100/s")
        page.fill(f"{row} form.resume input[name=reason]", "consumers are back")
        page.click(f"{row} form.resume button")
        page.wait_for_selector("#control-changed")
        assert page.text_content("#control-state") == "delivering, catch-up 100.0/s"
        reader.until(lambda: sorted(k for k in keys(reader) if k) == [
            b"held-0", b"held-1", b"held-2"], "the held records, after the resume")
    finally:
        reader.close()
        admin.delete_topics([paused])[paused].result(timeout=30)
        d = stack.deployment  # no control left behind for the topic gone
        controls.write_control(Settings(bootstrap_servers=d.bootstrap),
                               Subject(Scope.TARGET, paused), Control())


def _due_of(message: Any) -> int:
    """The ``kdelay-due-ms`` of a delivered record."""
    raw = dict(message.headers() or [])["kdelay-due-ms"]
    return int(raw.decode() if isinstance(raw, bytes) else raw)


def _api(page: Any, url: str) -> Any:
    page.goto(url)
    return json.loads(page.text_content("body") or "{}")


def test_deliveries_and_lateness_show_what_the_target_received(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any],
        received: Receiver, shots: Path) -> None:
    """Three records due now: the history lists each with its id, target offset and
    lateness as the target holds them; the lateness screen sums up exactly the target's
    deliveries of its window, none early; the trace of one ends at its target record."""
    now_ms = int(time.time() * 1000)
    names = [f"deliv-{n}" for n in range(3)]
    for n, name in enumerate(names):
        producer.send(stack.target, f"d{n}", key=name, due=now_ms + 200 * n, id=name)
    received.until(lambda: all(n.encode() in keys(received) for n in names), "deliv-*")
    held = {r.message.key(): r.message for r in received.received}
    page = page_of()
    page.goto(f"{stack.open.url}/deliveries?target={stack.target}")
    for name in names:
        message = held[name.encode()]
        due = _due_of(message)
        row = page.query_selector(f"#deliveries tr[data-id='{name}']")
        assert row is not None, page.text_content("#deliveries")
        assert row.get_attribute("data-offset") == str(message.offset())
        assert row.get_attribute("data-lateness-ms") == str(message.timestamp()[1] - due)
    page.screenshot(path=shots / "deliveries.png", full_page=True)

    found = _api(page, f"{stack.open.url}/api/v1/lateness?window=15m&target={stack.target}")
    delivered = [r.message for r in received.received
                 if r.message.timestamp()[1] >= found["since_ms"]
                 and "kdelay-origin" in dict(r.message.headers() or [])]
    late = sorted(m.timestamp()[1] - _due_of(m) for m in delivered)
    (row,) = found["targets"]
    assert (row["target"], row["count"], row["early"], row["max_ms"]) == (
        stack.target, len(late), 0, late[-1])
    page.goto(f"{stack.open.url}/lateness?window=15m")
    shown = page.query_selector(f"#lateness tr[data-target='{stack.target}']")
    assert shown is not None
    assert shown.get_attribute("data-early") == "0"
    hours = page.eval_on_selector_all(
        f"#lateness-hours tr[data-target='{stack.target}']",
        "rows => rows.map(r => +r.dataset.count)")
    assert sum(hours) == int(shown.get_attribute("data-count") or 0)
    page.screenshot(path=shots / "lateness.png", full_page=True)

    first = held[names[0].encode()]
    where = f"{stack.target}/{first.partition()}/{first.offset()}"
    deadline = time.monotonic() + SEEN_S
    while True:  # until the view holds the id's end (the service seals it soon after)
        page.goto(f"{stack.open.url}/record?ref={names[0]}")
        if where in (page.text_content("#trace") or ""):
            break
        assert time.monotonic() < deadline, page.text_content("#trace")
        time.sleep(0.5)
    steps = page.eval_on_selector_all("#trace td.step", "cells => cells.map(c => c.textContent)")
    assert "delivered" in steps
    assert "scheduled" in steps
    page.screenshot(path=shots / "record-delivered.png", full_page=True)


def test_a_series_page_shows_the_series_recent_runs(
        stack: Stack, producer: DelayProducer, page_of: Callable[..., Any],
        shots: Path) -> None:
    """A series every 2 s driven by a real ``kdelay worker``: the series page lists its
    runs, newest first, each delivered at or after its due time."""
    suffix = uuid.uuid4().hex[:8]
    env = {**cli_env(stack), "KDELAY_WORKER_GROUP_ID": f"web-worker-{suffix}"}
    made = run_cli(env, "worker", "--create-topics")
    assert made.returncode == 0, made.stderr
    log_path = stack.view_dir.parent / f"worker-{suffix}.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen([*kdelay_command(), "worker"], env=env,
                                  stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT)
    series_id = f"ticks-{suffix}"
    try:
        now_ms = int(time.time() * 1000)
        recurring.start(producer, stack.target, "tick", recurring.every("2s", now_ms),
                        schedule_id=series_id, now_ms=now_ms)
        page = page_of()
        runs = f"#series tr[data-id='{series_id}'] ul.runs li[data-n]"
        deadline = time.monotonic() + 2 * SEEN_S
        while True:  # until the worker has run the series twice
            page.goto(stack.open.url + "/series")
            if len(page.query_selector_all(runs)) >= 2:
                break
            assert worker.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, page.text_content("#series")
            time.sleep(0.5)
        numbers = page.eval_on_selector_all(runs, "items => items.map(i => +i.dataset.n)")
        lateness = page.eval_on_selector_all(
            runs, "items => items.map(i => +i.dataset.latenessMs)")
        assert numbers == sorted(numbers, reverse=True)
        assert numbers[-1] >= 1
        assert all(ms >= 0 for ms in lateness), lateness
        page.screenshot(path=shots / "series-runs.png", full_page=True)
        found = _api(page, stack.open.url + "/api/v1/series")
        (row,) = [item for item in found["items"] if item["schedule_id"] == series_id]
        listed = [run["n"] for run in row["runs"]]
        assert listed == sorted(listed, reverse=True)
        assert set(numbers) <= set(listed), "read after the page, the API has its runs too"
    finally:
        recurring.cancel(_settings(stack), producer, series_id, int(time.time() * 1000))
        worker.kill()
        worker.wait(timeout=30)
