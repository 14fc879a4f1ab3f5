"""Restore probe: a state dir's loss replayed alone, timed by wall, process and thread CPU.

``prepare`` builds a deployment as the bench's capacity scenario does
(``tools/bench --scenarios capacity``): ``--count`` requests with small
originals, round-robin over ``--partitions``, indexed by an in-process service
with ``kdelay run``'s defaults, which is then stopped. Its topics stay on the
broker and its state dir on disk; a JSON file (``--deployment``) names them.

``run`` restores every changelog partition of that deployment into fresh
stores with :func:`kdelay.state.changelog.rebuild` (what ``kdelay restore
--fresh`` runs), and prints one line: entries, wall seconds, entries a second,
process and main-thread CPU an entry (``time.thread_time``), the CPU of the
process's threads by name (librdkafka's ``rdk``, RocksDB's flush and
compaction pools), and whether each restored store equals the service's own
(entries, tally, ids, watermark, consumed offset). Run it with ``PYTHONPATH``
naming the ``src`` of the code to measure, alternating two checkouts on the
same deployment. ``--delete`` removes the deployment's topics and files.

Usage: ``PYTHONPATH=tools:src .venv/bin/python tools/restore_probe.py prepare|run|delete``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from kdelay import native
from kdelay.state.changelog import Restorer, rebuild
from kdelay.state.index import CONSUMED, PartitionIndex

BOOTSTRAP = "127.0.0.1:9092"


def prepare(path: Path, bootstrap: str, count: int, partitions: int) -> None:
    """Load and index ``count`` requests as the capacity scenario does; describe them in
    ``path``."""
    from kdelay_bench import capacity
    from kdelay_bench.broker import Topics
    from kdelay_bench.inproc import InProcess
    from kdelay_bench.throughput import Setup

    from kdelay.plumbing.clock import SystemClock

    work = Path(tempfile.mkdtemp(prefix="restore-probe-"))
    topics = Topics(bootstrap, "rp" + uuid.uuid4().hex[:6])
    setup = Setup(topics, work, partitions, 100, 1_000)
    settings = setup.deployment(f"cap{count}")
    target = setup.topics.create(f"cap{count}-target", partitions)
    capacity._load(setup, settings, target, count, SystemClock().now_ms())
    service = InProcess(settings, capacity._clock_at(0))
    try:
        service.intake(count, timeout_s=max(600.0, count / 2_000))
        service.step_for(3.0)
    finally:
        service.close()
    path.write_text(json.dumps({
        "bootstrap": bootstrap, "changelog": settings.changelog_topic,
        "partitions": partitions, "state_dir": str(settings.state_dir),
        "topics": [settings.requests_topic, settings.changelog_topic, settings.dlq_topic,
                   target], "work": str(work), "count": count}, indent=1))
    print(path.read_text())


def digest(index: PartitionIndex) -> str:
    """A hash of what a store holds: entries, tally rows, ids, watermark, consumed offset."""
    found = hashlib.sha256()
    for key, raw in index.raw_items():
        found.update(key)
        found.update(raw)
    for row in sorted(index.tally.all_rows()):
        found.update(repr(row).encode())
    for pair in sorted(index.id_states()):
        found.update(repr(pair).encode())
    found.update(repr((index.watermark, index.offset(CONSUMED))).encode())
    return found.hexdigest()


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of this process's live threads, by name."""
    tick = os.sysconf("SC_CLK_TCK")
    found: collections.defaultdict[str, float] = collections.defaultdict(float)
    for task in Path("/proc/self/task").iterdir():
        stat = (task / "stat").read_text()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        found[name.split(":")[0] if name.startswith("rdk") else name] += (
            int(fields[11]) + int(fields[12])) / tick
    return {name: round(seconds, 2) for name, seconds in
            sorted(found.items(), key=lambda pair: -pair[1])}


def service_store(state_dir: Path, partition: int) -> Path:
    """The service's store of ``partition`` under its state dir."""
    return next(path for path in state_dir.iterdir() if path.name.endswith(f"-{partition}"))


def run(deployment: dict[str, object], label: str, check: bool) -> None:
    """Restore every partition into fresh stores; print the figures (see the module)."""
    partitions = list(range(int(str(deployment["partitions"]))))
    root = Path(tempfile.mkdtemp(prefix="restore-probe-run-"))
    restorer = Restorer({"bootstrap.servers": str(deployment["bootstrap"])},
                        str(deployment["changelog"]))
    start, cpu, main = time.monotonic(), time.process_time(), time.thread_time()
    replayed = rebuild(restorer, lambda p: root / f"p{p}", partitions=partitions)
    wall, cpu, main = (time.monotonic() - start, time.process_time() - cpu,
                       time.thread_time() - main)
    threads = thread_cpu_s()
    restorer.close()
    entries = sum(replayed.values())
    verdict = "not checked"
    if check:
        state_dir = Path(str(deployment["state_dir"]))
        differ = []
        for partition in partitions:
            mine = PartitionIndex(root / f"p{partition}", partition)
            theirs = PartitionIndex(service_store(state_dir, partition), partition)
            try:
                if digest(mine) != digest(theirs):
                    differ.append(partition)
            finally:
                mine.close()
                theirs.close()
        verdict = f"stores DIFFER: {differ}" if differ else "stores equal the service's"
    shutil.rmtree(root, ignore_errors=True)
    print(f"{time.strftime('%H:%M:%S', time.gmtime())} {label} ({native.mode}), load "
          f"{os.getloadavg()[0]:.1f}: {entries} entries in {wall:.2f} s, "
          f"{entries / wall / 1e3:.0f} k/s; CPU an entry: process {cpu / entries * 1e6:.2f} us, "
          f"main thread {main / entries * 1e6:.2f} us; {verdict}; threads' CPU s {threads}",
          flush=True)


def delete(deployment: dict[str, object]) -> None:
    """Delete the deployment's topics and files."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": str(deployment["bootstrap"])})
    named = deployment["topics"]
    topics = [str(topic) for topic in named] if isinstance(named, list) else []
    for future in admin.delete_topics(topics, operation_timeout=30).values():
        future.result(timeout=30)
    shutil.rmtree(str(deployment["work"]), ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["prepare", "run", "delete"])
    parser.add_argument("--deployment", type=Path, default=Path("restore-probe.json"),
                        help="the JSON file that describes the deployment")
    parser.add_argument("--bootstrap-servers", default=BOOTSTRAP)
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--label", default="run")
    parser.add_argument("--no-check", action="store_true",
                        help="do not compare the restored stores with the service's")
    options = parser.parse_args()
    if options.command == "prepare":
        prepare(options.deployment, options.bootstrap_servers, options.count,
                options.partitions)
        return
    deployment = json.loads(options.deployment.read_text())
    if options.command == "run":
        run(deployment, options.label, not options.no_check)
    else:
        delete(deployment)


if __name__ == "__main__":
    main()
