"""The peer: etf1's kafka-message-scheduler (Go), built from source, run beside kdelay.

``tools/bench --peer PATH`` runs the burst, intake and steady scenarios a
second time against this scheduler, on the same broker with the same records,
and the report puts the two side by side. The binary is never committed:
``tools/peer build`` (``python -m kdelay_bench.peer build``) builds it from
commit :data:`COMMIT` with ``go build ./cmd/kafka`` into a cache directory
outside the repository, its Go dependencies from the module proxy.

Its protocol (read from its source at that commit): it consumes the topics of
``SCHEDULES_TOPICS``; a schedule is a record keyed by its id, with headers
``scheduler-epoch`` (the due time, whole seconds since the epoch),
``scheduler-target-topic`` and ``scheduler-target-key``. Each schedule due
today becomes a Go timer holding the whole record; when it fires the record
is produced to its target (headers kept, plus ``scheduler-key``, the
schedule's id), then a tombstone to the schedules topic and a copy to
``HISTORY_TOPIC``. Records more than a second old when read (a backlog, or a
lagging consumer) wait in a "missed" map until no record has come for a
second, then are planned or, when already due, sent at once. A schedule found
due in the past is dropped (tombstoned) unless ``SCHEDULE_GRACE_INTERVAL``
allows it; the bench sets a day, so a slow peer is late, never lossy.
Logging is at ``error`` (its default, ``info``, writes lines per record).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
from kafka_broker import free_ports
from prometheus_client.parser import text_string_to_metric_families

from kdelay.protocol import envelope
from kdelay.protocol.envelope import Headers
from kdelay_bench.load import WARMUP
from kdelay_bench.process import SchedulerProcess

MODULE = "github.com/etf1/kafka-message-scheduler"
REPOSITORY = "https://github.com/etf1/kafka-message-scheduler"
COMMIT = "7e86af4"
PROXY = "https://proxy.golang.org"
BINARY = f"kafka-message-scheduler-{COMMIT}"
EPOCH = "scheduler-epoch"
TARGET_TOPIC = "scheduler-target-topic"
TARGET_KEY = "scheduler-target-key"
ORIGINAL_KEY = "scheduler-key"  # set by the peer on what it delivers: the schedule's id
EVENTS = "kafka_scheduler_event_total"
PLANNED = "kafka_scheduler_planned_schedule"
MISSED = "kafka_scheduler_missed_schedule"
GRACE_S = 86_400


class PeerError(Exception):
    """The peer could not be built or started; the message says why."""


def default_cache() -> Path:
    """Return where ``build`` puts the binary: ``$XDG_CACHE_HOME/kdelay-bench/peer``
    (``~/.cache`` without it), outside any repository."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kdelay-bench" / "peer"


def epoch_s(due_ms: int) -> int:
    """Return the peer's due time for ``due_ms``: whole seconds, rounded up, so the
    peer is never asked for an instant before the one kdelay is asked for."""
    return -(-due_ms // 1000)


def schedule_headers(target: str, due_ms: int, key: bytes) -> Headers:
    """Return the headers of a schedule for ``target`` due at ``due_ms``.

    The record keeps its key as the target key. ``kdelay-due-ms`` carries the
    instant the peer was asked for (``epoch * 1000``); the peer copies it to
    the target record, so the bench's collector measures the peer's lateness
    exactly as kdelay's.
    """
    epoch = epoch_s(due_ms)
    return [(EPOCH, str(epoch).encode()), (TARGET_TOPIC, target.encode()),
            (TARGET_KEY, key), (envelope.DUE_MS, str(epoch * 1000).encode())]


def steady_headers(target: str, due_ms: int, key: bytes, warmup: bool) -> Headers:
    """Return :func:`schedule_headers`, with the bench's warm-up tag when ``warmup``
    (the peer copies it to the target, where the collector leaves it out)."""
    tag: Headers = [(WARMUP, b"1")] if warmup else []
    return [*schedule_headers(target, due_ms, key), *tag]


def due_today(due_ms: int, now_s: float | None = None) -> bool:
    """Whether ``due_ms`` falls before the end of today in local time (the peer plans
    only schedules due today: later ones wait for its midnight reload)."""
    today = time.localtime(time.time() if now_s is None else now_s)
    end = time.mktime((today.tm_year, today.tm_mon, today.tm_mday, 23, 59, 59, 0, 0, -1))
    return epoch_s(due_ms) <= end


def planned(exposition: str) -> int:
    """Return how many schedules the peer has taken in, from its metrics text: those
    planned on a timer plus those it found already due ("missed") and sent at once."""
    total = 0.0
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == EVENTS and sample.labels.get("type") in (PLANNED, MISSED):
                total += sample.value
    return int(total)


@dataclass(frozen=True, slots=True)
class PeerTopics:
    """The topics one peer run uses: its schedules, its history and its group."""

    schedules: str
    history: str
    group: str


def environment(bootstrap: str, topics: PeerTopics, metrics_port: int,
                server_port: int) -> dict[str, str]:
    """Return the environment the peer runs with (its configuration is environment
    variables only): quiet logging, its HTTP servers on loopback ports, a grace of a
    day for schedules found overdue."""
    return {"BOOTSTRAP_SERVERS": bootstrap, "SCHEDULES_TOPICS": topics.schedules,
            "HISTORY_TOPIC": topics.history, "GROUP_ID": topics.group,
            "LOG_LEVEL": "error", "METRICS_ADDR": f"127.0.0.1:{metrics_port}",
            "SERVER_ADDR": f"127.0.0.1:{server_port}",
            "SCHEDULE_GRACE_INTERVAL": str(GRACE_S)}


class PeerProcess(SchedulerProcess):
    """One running peer: its process, and its metrics endpoint for progress."""

    def __init__(self, binary: Path, bootstrap: str, topics: PeerTopics, log: Path) -> None:
        metrics_port, server_port = free_ports(2)
        super().__init__([str(binary)], log, metrics_port, planned, env={
            **os.environ, **environment(bootstrap, topics, metrics_port, server_port)})


def _run(command: list[str], cwd: Path | None = None,
         env: dict[str, str] | None = None) -> str:
    """Run ``command``; return its stdout, raise :class:`PeerError` with its stderr."""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise PeerError(f"{' '.join(command)} failed (rc={done.returncode}): "
                        f"{done.stderr.strip()[-800:]}")
    return done.stdout


def _go_env(work: Path) -> dict[str, str]:
    """The Go settings of a build: dependencies from the module proxy (``GOPROXY`` if
    set), checked against the checksum database, go.mod as the source has it."""
    return {**os.environ, "GOPROXY": os.environ.get("GOPROXY", PROXY), "GOFLAGS": "-mod=mod",
            "GOTOOLCHAIN": "local", "GOPATH": os.environ.get("GOPATH", str(work / "gopath"))}


def _from_proxy(work: Path, env: dict[str, str]) -> Path:
    """Download the module at :data:`COMMIT` from the proxy; return a writable copy."""
    done = subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{COMMIT}"],
                          cwd=work, env=env, capture_output=True, text=True, check=False)
    try:  # on failure too, the error is in the JSON on stdout
        answer = orjson.loads(done.stdout)
    except orjson.JSONDecodeError:
        answer = {"Error": done.stderr.strip()[-400:] or f"rc={done.returncode}"}
    if "Error" in answer or "Dir" not in answer:
        raise PeerError(f"module proxy: {answer.get('Error', 'no source directory')}")
    source = work / "src"
    shutil.copytree(answer["Dir"], source)
    source.chmod(0o755)
    for path in source.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return source


def _from_git(work: Path, repository: str) -> Path:
    """Extract :data:`COMMIT` from a git repository (a path or a URL); return it."""
    git_dir = Path(repository)
    if not git_dir.exists():
        git_dir = work / "clone"
        _run(["git", "clone", "--bare", "--quiet", repository, str(git_dir)])
    source = work / "src"
    source.mkdir()
    archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", COMMIT],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise PeerError(f"git archive {COMMIT} in {git_dir}: {archive.stderr.decode()[-400:]}")
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    return source


def _git_dir(path: str) -> str:
    """Return the git directory of ``path``: itself when bare, else its ``.git``."""
    candidate = Path(path)
    return str(candidate / ".git") if (candidate / ".git").exists() else path


def build(cache: Path, source: str | None = None) -> Path:
    """Build the peer into ``cache``; return the binary's path.

    The source of commit :data:`COMMIT` comes from ``source`` (a git repository:
    a path or URL) when given, else from the module proxy, else from a clone of
    :data:`REPOSITORY`. Then ``go build ./cmd/kafka`` fetches the dependencies
    from the proxy. A binary already built is returned as it is. Raises
    :class:`PeerError` when every source fails or the build does.
    """
    binary = cache / BINARY
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="peer-build-", dir=cache) as scratch:
        work = Path(scratch)
        env = _go_env(work)
        if source is not None:
            tree = _from_git(work, _git_dir(source))
        else:
            try:
                tree = _from_proxy(work, env)
            except PeerError as exc:
                print(f"tools/peer: {exc}; cloning {REPOSITORY}", file=sys.stderr)
                tree = _from_git(work, REPOSITORY)
        _run(["go", "build", "-trimpath", "-o", str(binary), "./cmd/kafka"], cwd=tree, env=env)
        if "GOPATH" not in os.environ:  # the module cache is read-only: Go removes its own
            _run(["go", "clean", "-modcache"], cwd=tree, env=env)
    return binary


def main(argv: list[str] | None = None) -> int:
    """``tools/peer build [--cache DIR] [--source GIT]``: build the peer, print its path."""
    p = argparse.ArgumentParser(prog="tools/peer", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help=f"build {MODULE}@{COMMIT} (go build ./cmd/kafka)")
    b.add_argument("--cache", type=Path, default=default_cache(),
                   help="directory for the binary (default: %(default)s)")
    b.add_argument("--source", help="a git repository (path or URL) holding the commit; "
                   "default: the module proxy, else a clone from GitHub")
    args = p.parse_args(argv)
    try:
        print(build(args.cache, args.source))
    except PeerError as exc:
        print(f"tools/peer: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
