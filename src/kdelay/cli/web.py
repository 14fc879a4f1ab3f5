"""``kdelay web``: the web console and its JSON API, served by uvicorn in one process.

Reads the same settings as every command (common options, ``KDELAY_*``,
``--kafka-config``); the console's own options are ``--web-*``. Needs the
``web`` extra (FastAPI, uvicorn, Jinja2).
"""

from __future__ import annotations

import getpass
from pathlib import Path
from typing import Annotated

import typer

from kdelay.cli.options import (
    USER_ERROR_EXIT,
    common_options,
    connected,
    fail,
    failed,
    option,
    reported,
)
from kdelay.plumbing.clock import SystemClock

DEFAULT_WEB_VIEW_DIR = Path.home() / ".cache" / "kdelay" / "web-view"


@common_options
def web(
    ctx: typer.Context,
    web_host: Annotated[str, option(
        "web-host", "Address to bind; anything but loopback needs --web-users or "
        "--web-proxy-header.", shown="127.0.0.1")] = "127.0.0.1",
    web_port: Annotated[int, option("web-port", "Port to listen on.", shown=8080)] = 8080,
    web_users: Annotated[str | None, option(
        "web-users", "Users as name:role:hash, comma-separated; role viewer or operator; "
        "hash from --hash-secret. Sign in with basic auth or a bearer token.")] = None,
    web_proxy_header: Annotated[str | None, option(
        "web-proxy-header", "Trust this header (X-Forwarded-User) to name the user, from "
        "--web-proxy-addresses only.")] = None,
    web_proxy_addresses: Annotated[str, option(
        "web-proxy-addresses", "Addresses of the reverse proxy, comma-separated.",
        shown="127.0.0.1,::1")] = "127.0.0.1,::1",
    web_operators: Annotated[str, option(
        "web-operators", "Proxy users who act (the others only view), comma-separated.")] = "",
    web_show_payloads: Annotated[bool, option(
        "web-show-payloads", "Show payloads to viewers too (operators always see them).")]
    = False,
    web_redact: Annotated[str, option(
        "web-redact", "Header names and JSON field names (at any depth) whose values the "
        "console and the API show as ***, comma-separated; names compare case-insensitively.")]
    = "",
    audit_topic: Annotated[str, option(
        "audit-topic", "Topic of the console's audit records.", shown="kdelay.audit")]
    = "kdelay.audit",
    create_audit_topic: Annotated[bool, typer.Option(
        "--create-audit-topic/--no-create-audit-topic", envvar="KDELAY_CREATE_AUDIT_TOPIC",
        help="Create the audit topic when it is missing.")] = True,
    view_dir: Annotated[Path, option(
        "view-dir", "Where the console keeps its copy of the changelog (not the CLI's).",
        shown="~/.cache/kdelay/web-view")] = DEFAULT_WEB_VIEW_DIR,
    hash_secret: Annotated[bool, option(
        "hash-secret", "Read a secret (hidden) and print its hash for --web-users; serve "
        "nothing.")] = False,
) -> None:
    """Serve the web console and the JSON API (/api/v1) on --web-host:--web-port."""
    try:
        from kdelay.web import access, actions, app, console, reads
    except ImportError as exc:
        fail("web-extra-missing", f"the console needs the web extra: pip install "
             f"'kdelay[web]' ({exc.name} is missing)", USER_ERROR_EXIT)
    if hash_secret:
        typer.echo(access.hash_secret(getpass.getpass("secret: ")))
        return
    try:
        policy = access.Policy(
            bind=web_host, users=access.parse_users(web_users or ""),
            proxy_header=web_proxy_header or None,
            proxy_addresses=frozenset(_names(web_proxy_addresses)),
            proxy_operators=frozenset(_names(web_operators)),
            payloads_for_viewers=web_show_payloads)
        gate = access.Gate(policy)
    except access.AccessError as exc:
        failed(exc)
    with reported():
        settings = connected(ctx)
        if create_audit_topic and actions.ensure_audit_topic(settings, audit_topic):
            typer.echo(f"created the audit topic {audit_topic}", err=True)
        clock = SystemClock()
        acts = actions.Actions(settings, clock, audit_topic=audit_topic)
    shown = reads.Reads(settings, view_dir, clock, audit_topic=audit_topic,
                        redact=reads.Redaction.of(_names(web_redact)))
    shown.keep_current()
    served = console.Console(gate, shown, acts, clock)
    try:
        _serve(app.create_app(served), web_host, web_port)
    finally:
        acts.close()


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _serve(application: object, host: str, port: int) -> None:
    """Run uvicorn in this process until SIGINT or SIGTERM."""
    import uvicorn

    typer.echo(f"kdelay console on http://{'[' + host + ']' if ':' in host else host}:{port}/",
               err=True)
    uvicorn.run(application, host=host, port=port, log_level="info",  # type: ignore[arg-type]
                server_header=False)
