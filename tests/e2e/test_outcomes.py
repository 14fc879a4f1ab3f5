"""Ids end to end: ``kdelay send --id --wait``, ``kdelay cancel --wait`` and ``kdelay
reschedule --wait`` print the service's outcome and exit with its status, and an id's
first outcome outlives its delivery (exactly-once, the default settings otherwise; the
rebuild from the changelog is tests/integration/test_ids.py's, under both guarantees)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, run_cli

kafka = pytest.mark.kafka
EOS = {"KDELAY_GUARANTEE": "exactly-once"}


def _lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return result.stdout.splitlines()


@kafka
def test_outcomes_are_printed_with_their_exit_status_and_outlive_a_delivery(
    deploy: Callable[..., Deployment], start_kdelay: Callable[..., KdelayProcess],
    receiver: Callable[[list[str]], Receiver], topic_factory: TopicFactory, tmp_path: Path,
) -> None:
    run = uuid.uuid4().hex[:8]
    deployment = deploy(partitions=3)
    target = topic_factory(f"outcomes-{run}", 1)
    env = deployment.env(**EOS)
    kdelay = start_kdelay(deployment, **EOS)
    kdelay.wait_ready()
    held, sent = f"held-{run}", f"sent-{run}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(env, *args, "--timeout", "60s")

    first = cli("send", target, "--id", held, "--delay", "2h", "--value", "a", "--wait")
    assert first.returncode == 0, first.stderr
    coordinates, outcome = _lines(first)
    assert outcome == f"scheduled {held}"

    again = cli("send", target, "--id", held, "--delay", "3h", "--value", "b", "--wait")
    assert again.returncode == 3, again.stderr
    assert _lines(again)[1] == (f"duplicate {held} schedule={coordinates} first=pending "
                                "differs=payload-or-due-time")
    assert f"duplicate id dropped: id {held}" in kdelay.log()

    for ended in ("", " first=cancelled"):  # a second cancel gets the first one's answer
        cancelled = cli("cancel", held, "--wait")
        assert cancelled.returncode == 0, cancelled.stderr
        assert _lines(cancelled)[1] == f"cancelled {held} schedule={coordinates}{ended}"
    unknown = cli("cancel", f"ghost-{run}", "--wait")
    assert (unknown.returncode, _lines(unknown)[1]) == (4, f"unknown ghost-{run}")

    out = receiver([target])
    past = "2026-01-01T00:00:00Z"  # due at once, and the same due time when sent again
    now = cli("send", target, "--id", sent, "--due", past, "--value", "once", "--wait")
    assert now.returncode == 0, now.stderr
    out.until(lambda: len(out.received) == 1, "the record with an id")
    late = cli("cancel", sent, "--wait")
    assert (late.returncode, _lines(late)[1].split()[:2]) == (5, ["already-delivered", sent])

    moved = f"moved-{run}"
    far = cli("send", target, "--id", moved, "--delay", "2h", "--value", "moved", "--wait")
    assert far.returncode == 0, far.stderr
    too_far = cli("reschedule", moved, "--delay", "30d")
    assert too_far.returncode == 2
    assert too_far.stderr.startswith("error[delay-too-long]: ")
    soon = cli("reschedule", moved, "--delay", "1s", "--wait")
    assert soon.returncode == 0, soon.stderr
    assert _lines(soon)[1] == f"rescheduled {moved} schedule={_lines(far)[0]}", "same record"
    out.until(lambda: len(out.received) == 2, "the rescheduled record")
    delivered = out.received[1].message
    assert delivered.value() == b"moved"
    due_ms = int(dict(delivered.headers() or [])["kdelay-due-ms"] or b"0")
    assert due_ms <= delivered.timestamp()[1] < due_ms + 3_600_000, "the new time, never early"
    over = cli("reschedule", moved, "--delay", "1h", "--wait")
    assert (over.returncode, _lines(over)[1].split()[0]) == (5, "already-delivered")
    ghost = cli("reschedule", f"ghost-{run}", "--delay", "1h", "--wait")
    assert (ghost.returncode, _lines(ghost)[1]) == (4, f"unknown ghost-{run}")

    # The operator's views see a rescheduled entry at its new time.
    parked, first_ms = f"parked-{run}", int(time.time() * 1000) + 7_200_000
    for args in (("send", target, "--id", parked, "--due", str(first_ms), "--value", "p"),
                 ("reschedule", parked, "--due", str(first_ms + 3_600_000))):
        assert cli(*args, "--wait").returncode == 0
    views = {**env, "KDELAY_VIEW_DIR": str(tmp_path / "view")}
    shown = json.loads(run_cli(views, "show", parked, "--json").stdout)
    assert (shown["pending"], shown["due_ms"]) == (True, first_ms + 3_600_000)
    listed = run_cli(views, "due", "--within", "4h", "--json").stdout.splitlines()
    assert [json.loads(line)["due_ms"] for line in listed] == [first_ms + 3_600_000]
    late_again = cli("send", target, "--id", sent, "--due", past, "--value", "once", "--wait")
    assert late_again.returncode == 3, late_again.stderr
    assert _lines(late_again)[1].endswith("first=delivered"), "same payload and time: no conflict"
    out.drain(2.0)
    assert len(out.received) == 2, "each delivered once"
    assert kdelay.terminate() == 0


@kafka
def test_waiting_without_a_service_ends_with_no_outcome(
    deploy: Callable[..., Deployment],
) -> None:
    deployment = deploy(partitions=1)
    result = run_cli(deployment.env(), "cancel", "nobody-home", "--wait", "--timeout", "2s")
    assert result.returncode == 7, result.stderr
    assert result.stderr.startswith("error[no-outcome]: no outcome for nobody-home")
    wrong = run_cli(deployment.env(), "send", "t", "--delay", "1s", "--wait")
    assert wrong.returncode == 2
    assert "--wait needs --id" in wrong.stderr
