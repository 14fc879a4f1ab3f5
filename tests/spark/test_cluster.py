"""``kdelay audit``, ``forecast`` and ``schedule-table`` on a Spark standalone cluster.

One master and one worker, both from the installed PySpark (``spark-class``),
run on loopback for this module. The CLI runs the two jobs with
``--master spark://...``, each in a process of its own as a user runs them (the
two at once: most of each run is starting a driver and an executor); their JSON
must equal what the same jobs compute in local mode, and the worker must have
run an executor for each (in standalone mode no task runs in the driver, so the
Kafka source ran there, with the connector's jars shipped through
``spark.jars``). ``schedule-table`` then writes a table's requests through the
Kafka sink from the worker's executor, each on its id's partition. Both
daemons are stopped at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyspark
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from kafka_broker import free_ports  # tools/, on pytest's pythonpath
from pyspark.sql import SparkSession

from kdelay.plumbing.settings import Settings
from kdelay.protocol import codec, envelope
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.spark.audit import AuditWindow, audit
from kdelay.spark.forecast import ForecastWindow, forecast
from tests.conftest import TopicFactory, produce_all
from tests.e2e.conftest import Deployment, deploy, kdelay_command
from tests.spark.conftest import TEST_JVM_OPTIONS, cache_dir
from tests.spark.test_placement import java_partitions

__all__ = ["deploy"]
# The hang guard: each test starts JVMs of its own (a master, a worker, the jobs' drivers
# and executors) and took up to 240 s of the suite's 300 s on a loaded two-core machine.
pytestmark = [pytest.mark.kafka, pytest.mark.timeout(600)]
HOUR_MS = 3_600_000
READY_TIMEOUT_S = 90.0
JOB_TIMEOUT_S = 300.0
# One core and little memory per job (the worker has two cores, one for each of
# the two jobs run at once): the machine is shared, the data is a dozen records.
JOB_CONF = ("spark.executor.memory=512m", "spark.executor.cores=1", "spark.cores.max=1",
            "spark.driver.memory=512m", "spark.sql.shuffle.partitions=2",
            "spark.ui.enabled=false", f"spark.driver.extraJavaOptions={TEST_JVM_OPTIONS}",
            f"spark.executor.extraJavaOptions={TEST_JVM_OPTIONS}")


@dataclass(frozen=True)
class Cluster:
    """A running standalone master and worker: the master URL and both JSON status pages."""

    master: str
    master_ui: str
    worker_ui: str

    def status(self, which: str) -> dict[str, Any]:
        """The master's or worker's status page (``/json/``) as a dict."""
        url = self.master_ui if which == "master" else self.worker_ui
        with urllib.request.urlopen(f"{url}/json/", timeout=5) as reply:  # noqa: S310 - loopback
            found: dict[str, Any] = json.loads(reply.read())
            return found


def _spark_class(main: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start one Spark daemon with PySpark's ``spark-class``; its output goes to ``log``."""
    home = Path(pyspark.__file__).parent
    env = {**os.environ, "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_DAEMON_MEMORY": "256m", "SPARK_DAEMON_JAVA_OPTS": TEST_JVM_OPTIONS,
           "SPARK_NO_DAEMONIZE": "1"}
    with log.open("wb") as out:
        return subprocess.Popen([str(home / "bin" / "spark-class"), main, *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM one daemon we started, SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _until(what: str, check: Callable[[], bool], procs: list[subprocess.Popen[bytes]],
           logs: Path) -> None:
    """Poll ``check`` until true; fail when a daemon exits or the time-out passes.

    A status page that does not answer yet, or answers with HTML, is not ready: early
    in its start, on a loaded machine, the master once answered ``/json/`` with its UI's
    home page.
    """
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            if check():
                return
        except (OSError, ValueError):
            pass
        if any(proc.poll() is not None for proc in procs):
            pytest.fail(f"a Spark daemon exited before {what}; see {logs}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {READY_TIMEOUT_S:.0f}s; see {logs}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One standalone master and one worker (2 cores, 1 GiB) on 127.0.0.1, free ports."""
    logs = tmp_path_factory.mktemp("spark-cluster")
    port, ui, worker_port, worker_ui = free_ports(4)
    found = Cluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui}",
                    f"http://127.0.0.1:{worker_ui}")
    procs = [_spark_class("org.apache.spark.deploy.master.Master",
                          ["--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui)],
                          logs / "master.log")]
    try:
        _until("master", lambda: found.status("master")["status"] == "ALIVE", procs, logs)
        procs.append(_spark_class(
            "org.apache.spark.deploy.worker.Worker",
            ["--host", "127.0.0.1", "--port", str(worker_port), "--webui-port", str(worker_ui),
             "--cores", "2", "--memory", "1g", "--work-dir", str(logs / "work"), found.master],
            logs / "worker.log"))
        _until("registered worker", lambda: [w["state"] for w in found.status("master")[
            "workers"]] == ["ALIVE"], procs, logs)
        yield found
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _request(partition: int, target: str, due_ms: int,
             schedule_id: str | None = None) -> dict[str, object]:
    return {"partition": partition, "value": b"payload-" + target.encode(),
            "headers": envelope.schedule_headers(target, due_ms=due_ms,
                                                 schedule_id=schedule_id)}


def _seed(deployment: Deployment, target: str, base: int) -> None:
    """Requests of every outcome the audit tells apart without a service, and their traces.

    Delivered once and twice (copies written to the target as kdelay writes
    them), lost (due two hours ago, no trace), pending with a changelog entry,
    pending without one, cancelled and deduplicated.
    """
    producer = Producer({"bootstrap.servers": deployment.bootstrap})
    past, later = base - 2 * HOUR_MS, base + 2 * HOUR_MS + HOUR_MS // 2
    records = [
        _request(0, target, past), _request(0, target, past), _request(1, target, past),
        _request(1, target, later), _request(0, target, later + 3 * HOUR_MS),
        _request(0, target, later, schedule_id="c-1"),
        {"partition": 0, "headers": envelope.cancel_headers("c-1")},
        _request(1, target, later, schedule_id="dup"), _request(1, target, later,
                                                                 schedule_id="dup")]
    # Delivery reports come back in no particular order across partitions: a key
    # per record tells them apart.
    keyed = [{**record, "key": str(i).encode()} for i, record in enumerate(records)]
    sent = sorted(produce_all(producer, deployment.requests, keyed),
                  key=lambda m: int(m.key() or b"0"))
    at = [(int(m.partition() or 0), int(m.offset() or 0)) for m in sent]
    copies = [(at[0], past + 40), (at[1], past + 15), (at[1], past + 900)]
    produce_all(producer, target, [
        {"value": b"delivered", "timestamp": ts, "headers": envelope.delivery_tail(
            envelope.origin_of(deployment.requests, *origin), past)} for origin, ts in copies])
    entry = codec.encode_index_value(IndexValue(Fingerprint(0, 0), None))
    produce_all(producer, deployment.changelog, [
        {"partition": p, "key": codec.encode_due_key(due, p, o), "value": entry}
        for (p, o), due in ((at[3], later), (at[4], later + 3 * HOUR_MS), (at[7], later))])


def _relative(report: dict[str, Any]) -> dict[str, Any]:
    """A forecast's JSON with bucket starts relative to its ``now_ms``, which it drops."""
    now = report.pop("now_ms")
    for key in ("curve", "peaks"):
        report[key] = [{**b, "start_ms": b["start_ms"] - now} for b in report[key]]
    return report


def _cli_at_once(deployment: Deployment, cluster: Cluster, logs: Path,
                 *commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Run the CLI ``commands`` (``--json``, on ``cluster``) at the same time; their results.

    Their output goes to files under ``logs``, so that none waits on a full pipe.
    """
    conf = [arg for pair in JOB_CONF for arg in ("--conf", pair)]
    env = deployment.env(SPARK_LOCAL_IP="127.0.0.1")
    started: list[tuple[list[str], subprocess.Popen[bytes], Path]] = []
    try:
        for i, command in enumerate(commands):
            args = [*kdelay_command(), *command, "--json", "--master", cluster.master,
                    "--cache-dir", str(cache_dir()), *conf]
            out = logs / f"cli-{i}"
            with out.with_suffix(".out").open("wb") as stdout, \
                    out.with_suffix(".err").open("wb") as stderr:
                started.append((args, subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL,
                                                       stdout=stdout, stderr=stderr), out))
        deadline = time.monotonic() + JOB_TIMEOUT_S
        return [subprocess.CompletedProcess(
            args, proc.wait(timeout=max(1.0, deadline - time.monotonic())),
            out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text())
            for args, proc, out in started]
    finally:
        for _, proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def test_audit_and_forecast_on_a_standalone_cluster_equal_local_mode(
        cluster: Cluster, spark: SparkSession, deploy: Callable[..., Deployment],
        topic_factory: TopicFactory, tmp_path: Path) -> None:
    deployment = deploy(partitions=2)
    target = topic_factory("cluster-target")
    base = time.time_ns() // 1_000_000
    _seed(deployment, target, base)
    settings = Settings(bootstrap_servers=deployment.bootstrap,
                        requests_topic=deployment.requests,
                        changelog_topic=deployment.changelog, dlq_topic=deployment.dlq,
                        outcomes_topic=deployment.outcomes)
    local_audit, table = audit(spark, settings, AuditWindow(now_ms=base))
    table.unpersist()
    local_forecast, cube = forecast(spark, settings, ForecastWindow(base, 24 * HOUR_MS, HOUR_MS))
    cube.unpersist()

    audited, forecast_run = _cli_at_once(
        deployment, cluster, tmp_path, ("audit",),
        ("forecast", "--bucket", "1h", "--horizon", "24h"))
    assert audited.returncode == 4, audited.stderr  # one request is lost
    assert forecast_run.returncode == 0, forecast_run.stderr

    expected = orjson.loads(orjson.dumps(local_audit.to_json()))
    assert (expected["requests"], expected["delivered_once"], expected["delivered_more_than_once"],
            expected["lost"], expected["pending"], expected["cancelled"],
            expected["deduplicated"]) == (8, 1, 1, 1, 3, 1, 1)
    assert orjson.loads(audited.stdout) == expected
    expected_forecast = _relative(orjson.loads(orjson.dumps(local_forecast.to_json())))
    assert expected_forecast["pending"] == 3
    assert _relative(orjson.loads(forecast_run.stdout)) == expected_forecast
    _check_executors_ran_on_the_worker(cluster)


def _check_executors_ran_on_the_worker(cluster: Cluster) -> None:
    """Both applications finished on the master, each with an executor on the worker."""
    apps = {app["id"] for app in cluster.status("master")["completedapps"]
            if app["name"] == "kdelay"}
    assert len(apps) == 2
    deadline = time.monotonic() + 30
    while True:
        ran = {e["appid"] for e in cluster.status("worker")["finishedexecutors"]}
        if apps <= ran or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert apps <= ran


def test_schedule_table_on_a_standalone_cluster_writes_from_an_executor(
        cluster: Cluster, spark: SparkSession, deploy: Callable[..., Deployment],
        topic_factory: TopicFactory, tmp_path: Path) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("cluster-campaign")
    due = time.time_ns() // 1_000_000 + HOUR_MS
    ids = [f"cluster-{due}-{i}" for i in range(40)]
    table = tmp_path / "campaign.parquet"
    spark.createDataFrame([(sid, due, f"hello {sid}") for sid in ids],
                          "id string, due bigint, message string").write.parquet(str(table))
    before = {app["id"] for app in cluster.status("master")["completedapps"]}

    [run] = _cli_at_once(deployment, cluster, tmp_path, (
        "schedule-table", str(table), "--target", target, "--value-column", "message",
        "--rejects", str(tmp_path / "rejects")))
    assert run.returncode == 0, run.stderr
    assert orjson.loads(run.stdout)["sent"] == len(ids)
    placed = _placed_ids(deployment)
    assert sorted(placed) == sorted(ids)
    java = java_partitions(list(placed), (deployment.partitions,), tmp_path)
    assert list(placed.values()) == [p[0] for p in java]
    apps = {app["id"] for app in cluster.status("master")["completedapps"]} - before
    assert len(apps) == 1
    deadline = time.monotonic() + 30
    while not apps <= {e["appid"] for e in cluster.status("worker")["finishedexecutors"]}:
        assert time.monotonic() < deadline, "no executor of schedule-table on the worker"
        time.sleep(0.5)


def _placed_ids(deployment: Deployment) -> dict[str, int]:
    """Every request's id and the partition it was written to."""
    consumer = Consumer({"bootstrap.servers": deployment.bootstrap, "group.id": "cluster-read",
                         "enable.auto.commit": False})
    ends = [consumer.get_watermark_offsets(TopicPartition(deployment.requests, p), timeout=30)[1]
            for p in range(deployment.partitions)]
    consumer.assign([TopicPartition(deployment.requests, p, OFFSET_BEGINNING)
                     for p in range(deployment.partitions)])
    placed: dict[str, int] = {}
    deadline = time.monotonic() + 60
    try:
        while sum(ends) > 0 and len(placed) < sum(ends):
            assert time.monotonic() < deadline, f"read {len(placed)} of {sum(ends)} requests"
            for message in consumer.consume(1_000, timeout=0.2):
                found = dict(message.headers() or []).get(envelope.SCHEDULE_ID)
                assert isinstance(found, bytes)
                placed[found.decode()] = int(message.partition() or 0)
        return placed
    finally:
        consumer.close()
