"""Crash harness: SIGKILL ``kdelay run`` under load and prove nothing is lost.

A load thread writes requests continuously with mixed delays (already due,
sub-second, a few seconds), a share of them with a ``kdelay-id`` (one per
request, so none is a duplicate). Every request is placed by its key with the
producer's default partitioner, as a producer keyed by a business key would,
so most requests with an id land off their id's partition and kdelay forwards
them there: kills also fall between a forward and its indexing. ``kdelay run``
runs as a subprocess and is killed with SIGKILL at random moments and
restarted, sometimes with its state directory deleted (the index is then
rebuilt from the changelog); optionally the broker is killed and restarted
too. When the kills are done the load stops, a last instance drains what is
pending, and the target topic is read back with
a ``read_committed`` consumer:

- lost: a request never delivered (nor dead-lettered);
- early: a request whose first copy's timestamp (the delivery time) precedes its due time;
- duplicates: a request delivered more than once. Under ``exactly-once`` there
  must be none; under ``at-least-once`` every duplicate's first copy must have
  been delivered shortly before a kill (it was in the batch in flight).

Run ``tools/crash --help``. Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import harness
import kafka_broker
from confluent_kafka import Message
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from harness import Arrivals, Instance, Load, Mix, read_all

from kdelay.controls import write_control
from kdelay.plumbing.settings import Settings
from kdelay.protocol.controls import Control, Pause, Scope, Subject

KAFKA = harness.ROOT / "tools" / "kafka"
IN_FLIGHT_WINDOW_MS = 5_000


@dataclass
class Options:
    """What one harness run does."""

    bootstrap: str
    guarantee: str = "exactly-once"
    kills: int = 100
    rate: int = 200
    partitions: int = 3
    state_loss: float = 0.3
    broker_kills: int = 0
    min_up_s: float = 1.0
    max_up_s: float = 4.0
    drain_timeout_s: float = 180.0
    seed: int = 1
    ids: float = 0.3
    controls: float = 0.3
    """Probability that a kill also changes the target's control (pause, resume, cap)."""
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kdelay-crash-")))
    # The environment tools/kafka kills and restarts the broker with (a broker of
    # its own: KDELAY_CACHE_DIR); None: this process's, the broker tools/kafka runs.
    broker_env: Mapping[str, str] | None = None


@dataclass
class Report:
    """The outcome of a harness run."""

    guarantee: str
    kills: int
    broker_kills: int
    state_losses: int
    requests: int
    delivered: int
    lost: int
    duplicates: int
    unexplained_duplicates: int
    early: int
    dead_lettered: int
    seconds: float
    restarts_served: int = 0
    serving_median_s: float = 0.0
    serving_max_s: float = 0.0
    seed: int = 1

    @property
    def ok(self) -> bool:
        """Whether every check of the guarantee holds."""
        dupes_ok = self.duplicates == 0 if self.guarantee == "exactly-once" else (
            self.unexplained_duplicates == 0)
        return self.lost == 0 and self.early == 0 and dupes_ok and self.dead_lettered == 0

    def table(self) -> str:
        """Return the report as a markdown table."""
        rows = [(k, v) for k, v in asdict(self).items()] + [("ok", self.ok)]
        return "| measure | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def log(message: str) -> None:
    """Progress goes to stderr."""
    print(f"crash: {message}", file=sys.stderr, flush=True)


def create_topics(admin: AdminClient, names: dict[str, tuple[int, dict[str, str]]]) -> None:
    """Create topics, each ``name -> (partitions, config)``."""
    futures = admin.create_topics([NewTopic(n, p, 1, config=c) for n, (p, c) in names.items()])
    for future in futures.values():
        future.result(timeout=30)


def kill_broker(broker_env: Mapping[str, str] | None) -> bool:
    """SIGKILL the broker tools/kafka started and start it again on the same data.

    ``broker_env`` is the environment tools/kafka runs with (None: this
    process's). Returns False (and kills nothing) when the broker is not one
    tools/kafka runs.
    """
    if broker_env is None:
        env = {k: v for k, v in os.environ.items() if k != "KDELAY_BOOTSTRAP_SERVERS"}
    else:
        env = dict(broker_env)
    if subprocess.run([str(KAFKA), "status"], env=env, capture_output=True,
                      check=False).returncode != 0:
        log("the broker is not one tools/kafka runs; not killing it")
        return False
    subprocess.run([str(KAFKA), "kill"], env=env, check=True)
    subprocess.run([str(KAFKA), "start"], env=env, check=True, stdout=subprocess.DEVNULL)
    return True


def run(options: Options) -> Report:
    """Run the harness and return its report."""
    rng = random.Random(options.seed)
    admin = AdminClient({"bootstrap.servers": options.bootstrap})
    suffix = uuid.uuid4().hex[:8]
    topics = {f"crash.req.{suffix}": (options.partitions, {"retention.ms": "604800000"}),
              f"crash.chg.{suffix}": (options.partitions, {
                  "cleanup.policy": "compact", "message.timestamp.type": "LogAppendTime"}),
              f"crash.dlq.{suffix}": (1, {}), f"crash.target.{suffix}": (3, {}),
              f"crash.out.{suffix}": (options.partitions, {"cleanup.policy": "compact,delete"}),
              f"crash.ctl.{suffix}": (1, {"cleanup.policy": "compact"})}
    create_topics(admin, topics)
    requests, changelog, dlq, target, outcomes, controls_topic = list(topics)
    changer = ControlChanger(Settings(bootstrap_servers=options.bootstrap,
                                      controls_topic=controls_topic), target, rng)
    env = {**os.environ, "KDELAY_BOOTSTRAP_SERVERS": options.bootstrap,
           "KDELAY_REQUESTS_TOPIC": requests, "KDELAY_CHANGELOG_TOPIC": changelog,
           "KDELAY_DLQ_TOPIC": dlq, "KDELAY_OUTCOMES_TOPIC": outcomes,
           "KDELAY_CONTROLS_TOPIC": controls_topic,
           "KDELAY_GROUP_ID": f"crash-{suffix}",
           "KDELAY_STATE_DIR": str(options.workdir / "state"),
           "KDELAY_GUARANTEE": options.guarantee}
    started = time.monotonic()
    load = Load(options.bootstrap, requests, target, Mix(options.rate, options.ids),
                options.seed)
    load.start()
    instance = Instance(options.workdir, env)
    instance.start()
    kill_times: list[int] = []
    state_losses = 0
    broker_kills = 0
    broker_kills_at = set(rng.sample(range(options.kills), min(options.broker_kills,
                                                                options.kills)))
    for k in range(options.kills):
        time.sleep(rng.uniform(options.min_up_s, options.max_up_s))
        kill_times.append(int(time.time() * 1000))
        instance.kill()
        if k in broker_kills_at:
            log(f"kill {k + 1}: broker too")
            broker_kills += kill_broker(options.broker_env)
        if rng.random() < options.state_loss:
            shutil.rmtree(instance.state_dir, ignore_errors=True)
            state_losses += 1
        if rng.random() < options.controls:
            log(f"kill {k + 1}: the target's control now: {changer.change()}")
        log(f"kill {k + 1}/{options.kills} (state losses so far: {state_losses})")
        instance.start()
    load.stop()
    changer.clear()
    log(f"load stopped after {len(load.due)} requests; draining")
    delivered = read_all(options.bootstrap, target, set(load.due), options.drain_timeout_s)
    code = instance.terminate()
    if code != 0:
        log(f"last instance exited with {code}; see {options.workdir}")
    dead = read_all(options.bootstrap, dlq, set(), 0.0)
    report = judge(options, load.due, delivered, dead, kill_times, (state_losses, broker_kills),
                   time.monotonic() - started)
    if report.unexplained_duplicates:
        instance.show_last_run()
    serving = instance.serving_times_s()
    if serving:
        report = replace(report, restarts_served=len(serving),
                         serving_median_s=round(statistics.median(serving), 2),
                         serving_max_s=round(max(serving), 2))
    return report


class ControlChanger:
    """Changes the target's control between kills: a pause, a resume with a catch-up rate,
    a cap, none. Controls change when records go out, never whether: the judge's
    verdict stays the same."""

    def __init__(self, settings: Settings, target: str, rng: random.Random) -> None:
        self._settings = settings
        self._subject = Subject(Scope.TARGET, target)
        self._rng = rng

    def change(self) -> str:
        """Write a random control for the target; say which."""
        now = int(time.time() * 1000)
        choice = self._rng.choice(["pause", "resume", "cap", "clear"])
        control = {
            "pause": Control(paused=Pause(now, "crash", "harness"), changed_ms=now),
            "resume": Control(catch_up_per_s=self._rng.choice([50.0, 500.0]), changed_ms=now),
            "cap": Control(rate_per_s=self._rng.choice([20.0, 100.0, 1000.0]), changed_ms=now),
            "clear": Control(),
        }[choice]
        write_control(self._settings, self._subject, control)
        return choice

    def clear(self) -> None:
        """Lift every control, so that the drain finds everything delivered."""
        write_control(self._settings, self._subject, Control())


def _copy(message: Message) -> str:
    """Where a delivered copy is, and the request it was made from (its origin header)."""
    return f"{message.partition()}/{message.offset()} from {harness.origin_of(message)}"


def judge(options: Options, due: dict[str, int], delivered: list[Message],
          dead: list[Message], kill_times: list[int], losses: tuple[int, int],
          seconds: float) -> Report:
    """Compare what was requested with what arrived: a duplicate is explained when its
    first copy went out at most ``IN_FLIGHT_WINDOW_MS`` before a kill (it was in flight)."""
    arrivals = Arrivals.of(delivered)
    duplicated = arrivals.duplicated()
    unexplained = arrivals.unexplained([(kill - IN_FLIGHT_WINDOW_MS, kill) for kill in kill_times])
    first = arrivals.first
    for rid in unexplained[:10]:
        copies = sorted((m for m in delivered if (m.key() or b"").decode() == rid),
                        key=lambda m: m.timestamp()[1])
        after = [k - first[rid] for k in kill_times if k >= first[rid]]
        log(f"duplicate not explained by a kill: {rid} due {due.get(rid)} delivered at "
            f"{[m.timestamp()[1] for m in copies]} ({', '.join(map(_copy, copies))}); "
            f"next kill {min(after) if after else None} ms after the first")
    lost = arrivals.lost(due)
    if lost:
        log(f"lost: {lost[:10]}")
    return Report(options.guarantee, options.kills, losses[1], losses[0], len(due),
                  len(arrivals.counts), len(lost), len(duplicated), len(unexplained),
                  len(arrivals.early(due)), len(dead), round(seconds, 1), seed=options.seed)


def main() -> int:
    """Parse the command line, run, print the table (and JSON with --json)."""
    parser = argparse.ArgumentParser(prog="tools/crash", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guarantee", choices=["at-least-once", "exactly-once", "both"],
                        default="exactly-once")
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--rate", type=int, default=200, help="requests per second")
    parser.add_argument("--state-loss", type=float, default=0.3,
                        help="probability that a restart finds its state dir deleted")
    parser.add_argument("--broker-kills", type=int, default=0,
                        help="how many of the kills also SIGKILL the broker")
    parser.add_argument("--seed", type=int, default=1,
                        help="the random seed of the first run; with --guarantee both the "
                        "second run takes the next one, so it kills at other moments")
    parser.add_argument("--ids", type=float, default=0.3,
                        help="share of requests with a kdelay-id (placed by key, not by id)")
    parser.add_argument("--min-up", type=float, default=1.0,
                        help="shortest time an instance runs before it is killed (s)")
    parser.add_argument("--max-up", type=float, default=4.0,
                        help="longest time an instance runs before it is killed (s)")
    parser.add_argument("--controls", type=float, default=0.3,
                        help="probability that a kill also changes the target's control")
    parser.add_argument("--json", type=Path, help="also write the reports as JSON here")
    args = parser.parse_args()
    guarantees = ["at-least-once", "exactly-once"] if args.guarantee == "both" else [
        args.guarantee]
    bootstrap = kafka_broker.address()
    reports = [run(Options(bootstrap, g, args.kills, args.rate, state_loss=args.state_loss,
                           broker_kills=args.broker_kills, min_up_s=args.min_up,
                           max_up_s=args.max_up, seed=args.seed + i, ids=args.ids,
                           controls=args.controls))
               for i, g in enumerate(guarantees)]
    for report in reports:
        print(report.table())
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"ok": r.ok} for r in reports], indent=2))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
