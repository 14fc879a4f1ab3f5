"""Who gets in, as whom, and what they may do: the gate's rules, through the real routes.

No broker: the app's reads and actions are stand-ins (``fakes.py``); the
gate, the routes and the error answers are the real ones.
"""

from __future__ import annotations

import pytest

from kdelay.web.access import (
    AccessError,
    Gate,
    Policy,
    Role,
    hash_secret,
    host_of,
    is_loopback,
    parse_users,
    verify_secret,
)
from kdelay.web.problems import Problem
from tests.unit.web.fakes import NOW_MS, SECRETS, basic, client, console_app, users_policy

ACTIONS = [("cancel", {}), ("reschedule", {"due": "2030-01-01T00:00:00Z"}), ("deliver-now", {})]


def test_a_secret_verifies_against_its_own_hash_only() -> None:
    encoded = hash_secret("s3cret", iterations=1_000)
    assert encoded.startswith("pbkdf2_sha256$1000$")
    assert "s3cret" not in encoded
    assert verify_secret("s3cret", encoded)
    assert not verify_secret("s3cret!", encoded)
    assert hash_secret("s3cret", iterations=1_000) != encoded  # salted


@pytest.mark.parametrize("text", ["olga:operator:plain", "olga:root:" + "pbkdf2_sha256$1$00$00",
                                  ":viewer:pbkdf2_sha256$1$00$00",
                                  "a:viewer:pbkdf2_sha256$1$00$00,a:viewer:pbkdf2_sha256$1$00$00"])
def test_malformed_users_are_refused_without_echoing_the_hash(text: str) -> None:
    with pytest.raises(AccessError) as caught:
        parse_users(text)
    assert caught.value.code == "invalid-users"
    assert "pbkdf2" not in str(caught.value)


def test_users_parse_with_their_roles() -> None:
    users = parse_users("a:viewer:pbkdf2_sha256$1$00$00\nb:operator:pbkdf2_sha256$1$00$00")
    assert [(u.name, u.role) for u in users] == [("a", Role.VIEWER), ("b", Role.OPERATOR)]
    assert "pbkdf2" not in repr(users)


def test_an_open_console_off_loopback_is_refused() -> None:
    with pytest.raises(AccessError) as caught:
        Gate(Policy(bind="0.0.0.0"))  # noqa: S104
    assert caught.value.code == "auth-required"
    Gate(Policy(bind="::1"))
    Gate(users_policy())


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("localhost", True),
    ("10.0.0.1", False), ("example.com", False), ("0.0.0.0", False)])  # noqa: S104
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_host_headers_lose_their_port() -> None:
    assert host_of("127.0.0.1:8080") == "127.0.0.1"
    assert host_of("[::1]:8080") == "::1"
    assert host_of("localhost") == "localhost"


def test_the_open_console_refuses_a_foreign_host_name() -> None:
    app, _, _ = console_app(Policy())
    assert client(app).get("/api/v1/session").json()["role"] == "operator"
    rebound = client(app, "http://evil.example:8080").get("/api/v1/session")
    assert rebound.status_code == 400
    assert rebound.json()["error"]["code"] == "host-not-allowed"


def test_without_credentials_the_api_answers_401_and_asks_for_basic_auth() -> None:
    app, _, _ = console_app(users_policy())
    answer = client(app).get("/api/v1/overview")
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "unauthenticated"
    assert answer.headers["www-authenticate"].startswith("Basic")
    assert client(app).get("/", headers={"Authorization": "Basic !!"}).status_code == 401


def test_basic_auth_and_bearer_tokens_sign_in() -> None:
    app, _, _ = console_app(users_policy())
    web = client(app)
    assert web.get("/api/v1/session", headers=basic("olga")).json()["role"] == "operator"
    bearer = {"Authorization": f"Bearer {SECRETS['vera']}"}
    assert web.get("/api/v1/session", headers=bearer).json()["name"] == "vera"
    wrong = {"Authorization": "Bearer not-a-secret"}
    assert web.get("/api/v1/session", headers=wrong).status_code == 401


def test_no_page_or_answer_renders_a_secret_or_its_hash() -> None:
    policy = users_policy()
    app, _, _ = console_app(policy)
    web = client(app)
    texts = [web.get(path, headers=basic("olga")).text
             for path in ("/", "/pending", "/timeline", "/record?ref=order-42",
                          "/api/v1/session", "/api/v1/openapi.json")]
    for user in policy.users:
        assert not any(user.secret_hash in text for text in texts)
    assert not any(secret in text for text in texts for secret in SECRETS.values())


@pytest.mark.parametrize(("action", "extra"), ACTIONS)
def test_a_viewer_gets_403_on_every_action_and_nothing_is_written(
        action: str, extra: dict[str, str]) -> None:
    app, _, actions = console_app(users_policy())
    web = client(app)
    token = web.get("/api/v1/session", headers=basic("vera")).json()["csrf_token"]
    api = web.post(f"/api/v1/actions/{action}", headers={**basic("vera"), "X-CSRF-Token": token},
                   json={"id": "order-42", "reason": "why not", **extra})
    assert api.status_code == 403
    assert api.json()["error"]["code"] == "forbidden"
    form = web.post(f"/record/{action}", headers=basic("vera"),
                    data={"id": "order-42", "reason": "why not", "csrf": token, **extra})
    assert form.status_code == 403
    assert "forbidden" in form.text
    assert actions.done == []


@pytest.mark.parametrize(("action", "extra"), ACTIONS)
def test_an_action_without_its_csrf_token_fails(action: str, extra: dict[str, str]) -> None:
    app, _, actions = console_app(users_policy())
    web = client(app)
    body = {"id": "order-42", "reason": "customer asked", **extra}
    for token in (None, "0" * 64):
        headers = basic("olga") if token is None else {**basic("olga"), "X-CSRF-Token": token}
        api = web.post(f"/api/v1/actions/{action}", headers=headers, json=body)
        assert (api.status_code, api.json()["error"]["code"]) == (403, "csrf-failed")
        form = web.post(f"/record/{action}", headers=basic("olga"),
                        data={**body, **({} if token is None else {"csrf": token})})
        assert form.status_code == 403
        assert "csrf-failed" in form.text
    assert actions.done == []


def test_an_operator_with_the_token_acts_and_sees_the_outcome() -> None:
    app, _, actions = console_app(users_policy())
    web = client(app)
    token = web.get("/api/v1/session", headers=basic("olga")).json()["csrf_token"]
    answer = web.post("/api/v1/actions/cancel", headers={**basic("olga"), "X-CSRF-Token": token},
                      json={"id": "order-42", "reason": "customer asked"})
    assert answer.status_code == 200
    assert answer.json()["outcome"] == "cancelled"
    form = web.post("/record/deliver-now", headers=basic("olga"),
                    data={"id": "order-42", "reason": "now please", "csrf": token})
    assert form.status_code == 200
    assert 'id="outcome-value">rescheduled' in form.text
    assert [(d.action, d.who, d.reason) for d in actions.done] == [
        ("cancel", "olga", "customer asked"), ("deliver-now", "olga", "now please")]


def test_a_csrf_token_is_one_principals_only() -> None:
    gate = Gate(users_policy(), key=b"k" * 32)
    olga, vera = (gate.identify(client=None, host=None, authorization=basic(n)["Authorization"],
                                proxy_user=None) for n in ("olga", "vera"))
    gate.check_csrf(olga, gate.csrf_token(olga))
    with pytest.raises(Problem):
        gate.check_csrf(olga, gate.csrf_token(vera))


def test_a_proxy_user_header_is_believed_only_from_the_proxy() -> None:
    policy = Policy(bind="0.0.0.0", proxy_header="X-Forwarded-User",  # noqa: S104
                    proxy_addresses=frozenset({"testclient"}), proxy_operators=frozenset({"ann"}))
    app, _, _ = console_app(policy)
    web = client(app)
    ann = web.get("/api/v1/session", headers={"X-Forwarded-User": "ann"}).json()
    bob = web.get("/api/v1/session", headers={"X-Forwarded-User": "bob"}).json()
    assert (ann["role"], bob["role"]) == ("operator", "viewer")
    assert web.get("/api/v1/session").status_code == 401
    elsewhere = Policy(bind="0.0.0.0", proxy_header="X-Forwarded-User")  # noqa: S104
    app, _, _ = console_app(elsewhere)  # the test client is not at a proxy address
    assert client(app).get("/api/v1/session",
                           headers={"X-Forwarded-User": "ann"}).status_code == 401


def test_payloads_are_hidden_from_viewers_unless_configured() -> None:
    app, reads, _ = console_app(users_policy())
    web = client(app)
    viewer = web.get("/record?ref=order-42", headers=basic("vera"))
    assert 'id="payload-hidden"' in viewer.text
    assert "the payload" not in viewer.text
    assert web.get("/api/v1/schedules/order-42", headers=basic("vera")).json()["payload"] is None
    assert "the payload" in web.get("/record?ref=order-42", headers=basic("olga")).text
    assert reads.payload_shown == [False, False, True]
    app, reads, _ = console_app(users_policy(payloads_for_viewers=True))
    assert "the payload" in client(app).get("/record?ref=order-42", headers=basic("vera")).text


def test_the_overview_shows_each_partition_serving_restoring_or_unknown() -> None:
    app, _, _ = console_app(Policy())
    web = client(app)
    page = web.get("/").text
    assert 'data-partition="0" data-state="serving"' in page
    assert 'data-partition="1" data-state="restoring"' in page
    assert "250 of 1000 changelog offsets (25 %)" in page
    assert "3.0 s ago" in page
    assert 'data-partition="2" data-state="unknown"' in page
    assert "no instance is assigned it" in page
    group = web.get("/api/v1/overview").json()["group"]
    assert group["partitions"]["1"] == {"state": "restoring", "done": 250, "total": 1000,
                                        "instance": "host-1", "as_of_ms": NOW_MS - 3_000,
                                        "why": None}
