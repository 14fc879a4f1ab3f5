"""The dead letters screen and API: the latest DLQ records, and one sent again.

No broker: the reads and actions are stand-ins (``fakes.py``); the real path (a
dead letter sent again and delivered) is in the browser tests.
"""

from __future__ import annotations

from kdelay.view.deadletters import decode, request_headers
from kdelay.web.access import Policy
from tests.unit.web.fakes import basic, client, console_app, dead_letter, users_policy


def test_a_dead_letter_is_decoded_and_resent_without_kdelays_error_headers() -> None:
    letter = dead_letter(0, 3, "undeliverable", schedule_id="order-9")
    found = decode(letter)
    assert (found.code, found.detail, found.schedule_id, found.target) == (
        "undeliverable", "why", "order-9", "orders")
    assert (found.origin, found.resendable) == ("kdelay.requests/0/1", True)
    assert [name for name, _ in request_headers(letter)] == [
        "kdelay-target", "kdelay-due-ms", "kdelay-id"]
    assert not decode(dead_letter(1, 5, "expired")).resendable, "its original was gone"


def test_the_api_lists_dead_letters_filtered_by_a_known_code() -> None:
    app, _, _ = console_app(Policy())
    web = client(app)
    every = web.get("/api/v1/dead-letters").json()["items"]
    assert sorted(item["code"] for item in every) == ["expired", "undeliverable"]
    chosen = web.get("/api/v1/dead-letters", params={"code": "expired"}).json()["items"]
    assert [(item["code"], item["resendable"]) for item in chosen] == [("expired", False)]
    wrong = web.get("/api/v1/dead-letters", params={"code": "nonsense"})
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (400, "invalid-code")


def _resend(path: str, body: dict[str, str], who: str | None = None) -> tuple[int, str, list[str]]:
    app, _, actions = console_app(users_policy() if who else Policy())
    web = client(app)
    auth = basic(who) if who else {}
    token = web.get("/api/v1/session", headers=auth).json()["csrf_token"]
    answer = web.post(path, json=body, headers={**auth, "X-CSRF-Token": token})
    code = answer.json()["outcome"] if answer.status_code == 200 else (
        answer.json()["error"]["code"])
    return answer.status_code, code, [done.action for done in actions.done]


def test_a_dead_letter_that_carries_its_request_is_sent_again_with_a_reason() -> None:
    status, outcome, done = _resend("/api/v1/dead-letters/0/3/resend", {"reason": "fixed"})
    assert (status, outcome, done) == (200, "scheduled", ["resend"])


def test_a_resend_is_refused_without_a_reason_a_record_or_a_request() -> None:
    assert _resend("/api/v1/dead-letters/0/3/resend", {"reason": ""})[:2] == (
        400, "reason-required")
    assert _resend("/api/v1/dead-letters/0/99/resend", {"reason": "r"})[:2] == (
        404, "no-dead-letter")
    assert _resend("/api/v1/dead-letters/1/5/resend", {"reason": "r"})[:2] == (
        409, "not-resendable")


def test_a_viewer_cannot_send_a_dead_letter_again() -> None:
    assert _resend("/api/v1/dead-letters/0/3/resend", {"reason": "r"}, "vera") == (
        403, "forbidden", [])


def test_the_page_lists_the_dead_letters_and_offers_a_send_only_where_it_can() -> None:
    app, _, _ = console_app(Policy())
    page = client(app).get("/dead-letters").text
    assert "order-9" in page
    assert "undeliverable" in page
    assert page.count('action="/dead-letters/resend"') == 1, "not for the expired one"
