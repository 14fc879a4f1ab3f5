"""``kdelay target pause|resume|limit|list``: the controls on deliveries to a target or lane."""

from __future__ import annotations

import getpass
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated

import orjson
import typer
from rich.console import Console
from rich.table import Table

from kdelay import controls
from kdelay.cli.options import (
    USER_ERROR_EXIT,
    common_options,
    connected,
    envvar,
    fail,
    failed,
    option,
    reported,
)
from kdelay.cli.view import DEFAULT_VIEW_DIR, ViewDir, operator_view
from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Settings
from kdelay.protocol.controls import Control, ControlError, Subject, parse_rate
from kdelay.view.backlog import HeldBack, held_back

Name = Annotated[str, typer.Argument(metavar="TARGET", help="The target topic (or lane, "
                                                            "with --lane).")]
Lane = Annotated[bool, option("lane", "TARGET names a lane: the control applies to every "
                                      "delivery of the lane's requests.")]
By = Annotated[str | None, option("by", "Who changes the control (kept and shown).",
                                  shown="the login name")]


@contextmanager
def _reported() -> Iterator[None]:
    """:func:`reported`, and the controls' own errors by their codes."""
    with reported():
        try:
            yield
        except controls.ControlsUnavailable as exc:
            failed(exc)
        except ControlError as exc:
            fail(exc.code, str(exc), USER_ERROR_EXIT)


def _change(ctx: typer.Context, name: str, lane: bool,
            apply: Callable[[Settings, Subject, int], Control]) -> None:
    """Apply one change to the control of TARGET (or lane) now and print what is in force."""
    with _reported():
        settings = connected(ctx)
        subject = controls.subject_of(name, lane, settings)
        control = apply(settings, subject, SystemClock().now_ms())
    typer.echo(f"{subject}: {_describe(control)}")


def _rate(text: str | None) -> float | None:
    try:
        return None if text is None else parse_rate(text)
    except ControlError as exc:
        fail(exc.code, str(exc), USER_ERROR_EXIT)


def _by(by: str | None) -> str:
    return by or getpass.getuser()


@common_options
def pause(ctx: typer.Context, name: Name, lane: Lane = False,
          reason: Annotated[str, option("reason", "Why (kept and shown).")] = "",
          by: By = None) -> None:
    """Pause deliveries to TARGET: what falls due stays pending until it is resumed."""
    _change(ctx, name, lane, lambda settings, subject, now_ms: controls.pause(
        settings, subject, _by(by), reason, now_ms))


@common_options
def resume(ctx: typer.Context, name: Name, lane: Lane = False,
           catch_up_rate: Annotated[str | None, option(
               "catch-up-rate", "Release what was held back at most this fast (500/s, "
                                "30000/m), oldest first; then normally.")] = None,
           by: By = None) -> None:
    """Resume deliveries to TARGET."""
    rate = _rate(catch_up_rate)
    _change(ctx, name, lane, lambda settings, subject, now_ms: controls.resume(
        settings, subject, _by(by), now_ms, rate))


@common_options
def limit(ctx: typer.Context, name: Name,
          rate: Annotated[str | None, typer.Argument(
              metavar="RATE", help="Deliveries a second (1000/s) or minute (60000/m), per "
                                   "instance; omit with --off.")] = None,
          off: Annotated[bool, option("off", "Lift the cap.")] = False,
          lane: Lane = False, by: By = None) -> None:
    """Cap deliveries to TARGET at RATE (per instance that serves it), or lift the cap."""
    if (rate is None) != off:
        fail("invalid-argument", "give a RATE, or --off", USER_ERROR_EXIT)
    cap = _rate(rate)
    _change(ctx, name, lane, lambda settings, subject, now_ms: controls.limit(
        settings, subject, _by(by), now_ms, cap))


@common_options
def list_command(ctx: typer.Context, as_json: Annotated[bool, typer.Option(
        "--json", envvar=envvar("json"), help="Print JSON.")] = False,
        backlog: Annotated[bool, typer.Option(
            "--backlog/--no-backlog", envvar=envvar("backlog"),
            help="Count what each control holds back (syncs the operator view, as "
                 "`kdelay due` does).")] = True,
        view_dir: ViewDir = DEFAULT_VIEW_DIR) -> None:
    """List the controls in force: paused since, by whom, why, caps, what each holds back.

    The held-back count is of the pending records due by now of the control's
    target (or lane), from the operator view.
    """
    with _reported():
        found = controls.read_controls(connected(ctx))
    held: dict[Subject, HeldBack] = {}
    if backlog and found:
        with operator_view(ctx, view_dir) as (_, view, originals, now_ms):
            held = held_back(view, originals, now_ms, found)
    ordered = sorted(found.items(), key=lambda item: str(item[0]))
    rows = [_row(subject, control, held.get(subject)) for subject, control in ordered]
    if as_json:
        typer.echo(orjson.dumps(rows).decode())
        return
    table = Table("scope", "name", "paused since", "by", "reason", "cap /s", "catch-up /s",
                  *(("held back", "oldest held due") if backlog else ()))
    for row in rows:
        table.add_row(*(str(row[c]) if row[c] is not None else "" for c in (
            "scope", "name", "paused_since", "paused_by", "reason", "rate_per_s",
            "catch_up_per_s", *(("held_back", "oldest_held_due") if backlog else ()))))
    Console().print(table if found else "no target controls in force")


def _row(subject: Subject, control: Control, held: HeldBack | None) -> dict[str, object]:
    paused = control.paused
    oldest = None if held is None else held.oldest_due_ms
    return {"scope": subject.scope.value, "name": subject.name,
            "held_back": None if held is None else held.count,
            "oldest_held_due": None if oldest is None else _when(oldest),
            "paused_since": None if paused is None else _when(paused.since_ms),
            "paused_by": None if paused is None else paused.by,
            "reason": None if paused is None else paused.reason,
            "rate_per_s": control.rate_per_s, "catch_up_per_s": control.catch_up_per_s,
            "changed": _when(control.changed_ms), "changed_by": control.changed_by}


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds")


def _describe(control: Control) -> str:
    parts = ["paused" if control.paused is not None else "delivering"]
    if control.rate_per_s is not None:
        parts.append(f"cap {control.rate_per_s:g}/s")
    if control.catch_up_per_s is not None:
        parts.append(f"catch-up {control.catch_up_per_s:g}/s")
    return ", ".join(parts)
