"""Scheduled tasks: a registry for ``kdelay worker``, and a script that schedules calls.

    python docs/examples/reminders.py             # schedule a call and a series
    PYTHONPATH=docs/examples kdelay worker --registry reminders:registry

Settings come from KDELAY_BOOTSTRAP_SERVERS, KDELAY_REQUESTS_TOPIC and
KDELAY_TASKS_TOPIC, as for the worker.
"""

from __future__ import annotations

import os
import uuid

from kdelay import tasks
from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Settings
from kdelay.recurring import every
from kdelay.tasks import Registry, Tasks

registry = Registry()


@registry.task("send-reminder", schema={"user": str, "text": str})
def send_reminder(user: str, text: str) -> None:
    """Pretend to notify ``user``; a series occurrence says which one it is."""
    series = tasks.context().series
    which = f" (occurrence {series.n} of {series.count})" if series else ""
    print(f"reminder for {user}: {text}{which}", flush=True)


def main() -> None:
    """Schedule one reminder in 1 s and a series of three, every 2 s."""
    settings = Settings(
        bootstrap_servers=os.environ.get("KDELAY_BOOTSTRAP_SERVERS", "localhost:9092"),
        requests_topic=os.environ.get("KDELAY_REQUESTS_TOPIC", "kdelay.requests"))
    topic = os.environ.get("KDELAY_TASKS_TOPIC", tasks.TASKS_TOPIC)
    with Tasks(settings, topic=topic, registry=registry) as client:
        print("one-off:", client.schedule("send-reminder", {"user": "ann", "text": "call Bob"},
                                          delay=1_000))
        now = SystemClock().now_ms()
        coordinates, first = client.recur(
            "send-reminder", {"user": "bob", "text": "stand-up"}, every("2s", now + 2_000),
            id=f"standup-{uuid.uuid4().hex[:6]}", count=3)
        print("series:", coordinates, "first due in", first - now, "ms")
        try:
            client.schedule("send-reminder", {"user": "ann"}, delay=1_000)
        except tasks.TaskRejected as exc:
            print(f"refused before sending: {exc.code}: {exc}")


if __name__ == "__main__":
    main()
