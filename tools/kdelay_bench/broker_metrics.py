"""The broker's own figures per run: where its requests waited, GC, safepoints, JIT.

When the bench drives a broker ``tools/kafka`` runs (it knows the pid), a small
Java program (``tools/jmx/BrokerMetrics.java``, run from source by ``java``)
attaches to the broker's JVM, starts its local JMX agent and answers each read
with the numeric attributes of a few MBeans and the JVM's safepoint counters.
The bench reads once before a run and once after and reports the difference,
so that a late request can be placed: held in the broker, and where, or not.

Per request kind (``Produce``; ``FetchConsumer``, every consumer's fetches,
the service's and the collector's; the transaction requests when a run had
any) and per part of a request's time in the broker (Kafka's
``RequestMetrics``: the total; ``queue``, waiting for a request handler
thread; ``local``, the handler at work; ``remote``, a produce waiting for
acknowledgements or a fetch for data; ``response_queue``, the response
waiting for its network thread; ``send``, sending it):

- ``<kind>_count``: requests completed in the run;
- ``<kind>[_<part>]_mean_ms``: the run's mean (exact: from the difference of
  the cumulative counts and means);
- ``<kind>[_<part>]_p999_ms`` and ``<kind>_p99_ms``: the broker's percentiles
  at the end of the run. Kafka keeps them in an exponentially decaying sample
  that weighs the last minute most but not only: a bad run shows in the next;
- ``<kind>[_<part>]_max_ms``: the longest since the broker started when this
  run set it (then it is this run's longest), else ``"<= N"``.

Then the JVM's: ``gc_young_count``, ``gc_young_s``, ``gc_old_count``,
``gc_old_s`` (G1's collections and their seconds in the run), ``safepoints``,
``safepoint_s`` (seconds every Java thread was stopped) and ``safepoint_sync_s``
(of which, waiting for all threads to stop), and ``jit_s`` (seconds of the JIT
compilers, over their threads).

And the CPU seconds the broker's Java threads used in the run: ``cpu_java_s``
all of them, of which ``cpu_handlers_s`` the request handlers (appends and
reads), ``cpu_network_s`` the network threads and ``cpu_cleaner_s`` the log
cleaner (compaction). GC's own threads are not Java threads: see ``gc_*``.
"""

from __future__ import annotations

import select
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import orjson

from kdelay_bench.report import Figure

SOURCE = Path(__file__).resolve().parent.parent / "jmx" / "BrokerMetrics.java"
REQUESTS = ("Produce", "FetchConsumer", "AddPartitionsToTxn", "EndTxn", "TxnOffsetCommit",
            "InitProducerId")
# Always reported, even when the run had none; the others only when it had some.
MAIN_REQUESTS = ("Produce", "FetchConsumer")
# Kafka's name of each part of a request's time -> the figure's infix ("" for the total).
PARTS = {"TotalTimeMs": "", "RequestQueueTimeMs": "_queue", "LocalTimeMs": "_local",
         "RemoteTimeMs": "_remote", "ResponseQueueTimeMs": "_response_queue",
         "ResponseSendTimeMs": "_send"}


def _bean(request: str, part: str) -> str:
    """The MBean of one part (:data:`PARTS`) of one request kind's time."""
    return f"kafka.network:type=RequestMetrics,name={part},request={request}"


PATTERNS = (
    *(_bean(request, part) for request in REQUESTS for part in PARTS),
    "java.lang:type=GarbageCollector,*",
    "java.lang:type=Compilation",
)
# The reader's pseudo-bean of JVM performance counters (ticks of sun.os.hrt.frequency).
PERF = "jvm:type=PerfCounter"
# The reader's pseudo-bean of Java threads' CPU ns, by name with digits folded to "N".
THREAD_CPU = "jvm:type=ThreadCpu"
# Figure -> what the thread names it sums contain.
THREAD_GROUPS = {"cpu_handlers_s": "request-handler", "cpu_network_s": "network-thread",
                 "cpu_cleaner_s": "log-cleaner"}
JAVA_OPTIONS = ("--add-exports", "jdk.internal.jvmstat/sun.jvmstat.monitor=ALL-UNNAMED")
GC = {"G1 Young Generation": "gc_young", "G1 Old Generation": "gc_old"}
READ_TIMEOUT_S = 60.0  # the first read compiles the program and attaches
NO_JAVA = "no java on PATH"

Beans = dict[str, dict[str, float]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One read: the reader's monotonic clock in ms and each bean's numeric attributes."""

    t_ms: float
    beans: Beans

    def attribute(self, bean: str, name: str) -> float:
        """Return one attribute, 0.0 when the bean or attribute is missing."""
        return float(self.beans.get(bean, {}).get(name, 0.0))


def parse(line: str) -> Snapshot:
    """Return the snapshot of one output line of the reader; ValueError if malformed."""
    try:
        raw = orjson.loads(line)
        beans = {str(name): {str(k): float(v) for k, v in attrs.items()}
                 for name, attrs in raw["beans"].items()}
        return Snapshot(float(raw["t_ms"]), beans)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"unreadable broker metrics line: {line[:200]!r}") from exc


def _run_mean(after: Snapshot, before: Snapshot, bean: str) -> float | None:
    """The mean of the observations made between two reads, from the cumulative ones."""
    count = after.attribute(bean, "Count") - before.attribute(bean, "Count")
    if count <= 0:
        return None
    total = (after.attribute(bean, "Count") * after.attribute(bean, "Mean")
             - before.attribute(bean, "Count") * before.attribute(bean, "Mean"))
    return round(max(total, 0.0) / count, 2)


def _max(after: Snapshot, before: Snapshot, bean: str) -> Figure:
    """The run's longest observation when it set a new maximum, else its upper bound."""
    top, earlier = after.attribute(bean, "Max"), before.attribute(bean, "Max")
    return round(top, 1) if top > earlier else f"<= {earlier:g}"


def _request_figures(after: Snapshot, before: Snapshot, request: str) -> dict[str, Figure]:
    total = _bean(request, "TotalTimeMs")
    count = round(after.attribute(total, "Count") - before.attribute(total, "Count"))
    if count <= 0 and request not in MAIN_REQUESTS:
        return {}
    p99 = round(after.attribute(total, "99thPercentile"), 1)
    out: dict[str, Figure] = {f"{request}_count": count, f"{request}_p99_ms": p99}
    for part, infix in PARTS.items():
        bean, name = _bean(request, part), f"{request}{infix}"
        out[f"{name}_mean_ms"] = _run_mean(after, before, bean)
        out[f"{name}_p999_ms"] = round(after.attribute(bean, "999thPercentile"), 1)
        out[f"{name}_max_ms"] = _max(after, before, bean) if count > 0 else None
    return out


def _ticks_s(after: Snapshot, before: Snapshot, counter: str) -> float:
    frequency = after.attribute(PERF, "sun.os.hrt.frequency") or 1e9
    change = after.attribute(PERF, counter) - before.attribute(PERF, counter)
    return round(change / frequency, 3)


def _thread_cpu(after: Snapshot, before: Snapshot) -> dict[str, Figure]:
    """CPU seconds of the broker's Java threads in the run, in all and by group (a thread
    that ended in the run takes its time with it: a group never goes below 0)."""
    used = {name: max(ns - before.attribute(THREAD_CPU, name), 0.0)
            for name, ns in after.beans.get(THREAD_CPU, {}).items()}
    out: dict[str, Figure] = {"cpu_java_s": round(sum(used.values()) / 1e9, 2)}
    for figure, part in THREAD_GROUPS.items():
        out[figure] = round(sum(ns for name, ns in used.items() if part in name) / 1e9, 2)
    return out


def figures(after: Snapshot, before: Snapshot) -> dict[str, Figure]:
    """Return the run's figures (see the module's text) from the reads around it."""
    out: dict[str, Figure] = {"seconds": round((after.t_ms - before.t_ms) / 1000, 1)}
    for request in REQUESTS:
        out.update(_request_figures(after, before, request))
    for name, key in GC.items():
        bean = f"java.lang:name={name},type=GarbageCollector"
        out[f"{key}_count"] = round(after.attribute(bean, "CollectionCount")
                                    - before.attribute(bean, "CollectionCount"))
        out[f"{key}_s"] = round((after.attribute(bean, "CollectionTime")
                                 - before.attribute(bean, "CollectionTime")) / 1000, 3)
    out["safepoints"] = round(after.attribute(PERF, "sun.rt.safepoints")
                              - before.attribute(PERF, "sun.rt.safepoints"))
    out["safepoint_s"] = _ticks_s(after, before, "sun.rt.safepointTime")
    out["safepoint_sync_s"] = _ticks_s(after, before, "sun.rt.safepointSyncTime")
    out.update(_thread_cpu(after, before))
    jit = "java.lang:type=Compilation"
    out["jit_s"] = round((after.attribute(jit, "TotalCompilationTime")
                          - before.attribute(jit, "TotalCompilationTime")) / 1000, 1)
    return out


def between(after: Snapshot | str, before: Snapshot | str) -> dict[str, Figure]:
    """Return the run's figures, or ``{"note": ...}`` when either read failed."""
    if isinstance(after, str):
        return {"note": after}
    if isinstance(before, str):
        return {"note": before}
    return figures(after, before)


class Reader:
    """The JMX reader attached to the broker with pid ``pid``; :meth:`read` returns a
    :class:`Snapshot` or a note saying why there is none, never raises."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._proc: subprocess.Popen[str] | None = None
        self._broken: str | None = None
        java = shutil.which("java")
        if pid is None:
            self._broken = "no broker pid: not a broker tools/kafka runs"
        elif java is None:
            self._broken = NO_JAVA
        else:
            self._proc = subprocess.Popen(
                [java, *JAVA_OPTIONS, str(SOURCE), str(pid), *PATTERNS], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read(self) -> Snapshot | str:
        """Ask for one snapshot; a note when the reader is gone or does not answer."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            return self._broken or "broker metrics reader closed"
        try:
            proc.stdin.write("read\n")
            proc.stdin.flush()
        except OSError:
            return self._fail("broker metrics reader exited")
        ready, _, _ = select.select([proc.stdout], [], [], READ_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line:
            return self._fail("broker metrics reader gave no answer")
        try:
            return parse(line)
        except ValueError as exc:
            return self._fail(str(exc))

    def _fail(self, why: str) -> str:
        err = self._end()
        self._broken = f"{why}: {err.splitlines()[-1][:300]}" if err else why
        return self._broken

    def close(self) -> None:
        """End the reader (closing its input ends it; killed if it lingers)."""
        self._end()

    def _end(self) -> str:
        """End the reader; return what it wrote on stderr."""
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err = proc.stderr.read().strip() if proc.stderr is not None else ""
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        return err
