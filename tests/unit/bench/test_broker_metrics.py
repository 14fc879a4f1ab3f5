"""The broker's own figures per run, from two reads of its MBeans: pure arithmetic."""

from __future__ import annotations

import orjson
import pytest
from kdelay_bench import broker_metrics
from kdelay_bench.broker_metrics import PERF, THREAD_CPU, Snapshot, between, figures, parse

PRODUCE = "kafka.network:type=RequestMetrics,name={},request=Produce"
FETCH = "kafka.network:type=RequestMetrics,name={},request=FetchConsumer"
END_TXN = "kafka.network:type=RequestMetrics,name={},request=EndTxn"
YOUNG = "java.lang:name=G1 Young Generation,type=GarbageCollector"


def histogram(count: float, mean: float, top: float, p999: float = 0.0) -> dict[str, float]:
    return {"Count": count, "Mean": mean, "Max": top, "99thPercentile": p999 / 2,
            "999thPercentile": p999}


def test_a_run_mean_comes_from_the_cumulative_counts_and_means() -> None:
    # 100 requests averaging 2 ms before; 300 more, averaging 10 ms, in the run.
    before = Snapshot(0, {PRODUCE.format("TotalTimeMs"): histogram(100, 2.0, 50)})
    after = Snapshot(60_000, {PRODUCE.format("TotalTimeMs"): histogram(400, 8.0, 50, 40)})
    got = figures(after, before)
    assert got["seconds"] == 60.0
    assert got["Produce_count"] == 300
    assert got["Produce_mean_ms"] == 10.0
    assert got["Produce_p999_ms"] == 40.0
    assert got["Produce_p99_ms"] == 20.0


def test_the_longest_request_is_exact_only_when_the_run_set_it() -> None:
    queue, reply = PRODUCE.format("RequestQueueTimeMs"), PRODUCE.format("ResponseQueueTimeMs")
    total = PRODUCE.format("TotalTimeMs")
    before = Snapshot(0, {total: histogram(10, 1, 30), queue: histogram(10, 1, 5),
                          reply: histogram(10, 1, 20)})
    after = Snapshot(1_000, {total: histogram(20, 1, 3160), queue: histogram(20, 1, 5),
                             reply: histogram(20, 1, 3160)})
    got = figures(after, before)
    assert got["Produce_max_ms"] == 3160.0
    assert got["Produce_response_queue_max_ms"] == 3160.0
    assert got["Produce_queue_max_ms"] == "<= 5"


def test_produce_and_fetch_always_show_and_transactions_only_when_there_were_any() -> None:
    before = Snapshot(0, {END_TXN.format("TotalTimeMs"): histogram(5, 10, 10)})
    idle = figures(Snapshot(1_000, {END_TXN.format("TotalTimeMs"): histogram(5, 10, 10)}), before)
    assert idle["Produce_count"] == 0
    assert idle["FetchConsumer_count"] == 0
    assert idle["Produce_mean_ms"] is None
    assert idle["Produce_max_ms"] is None
    assert "EndTxn_count" not in idle
    busy = figures(Snapshot(1_000, {END_TXN.format("TotalTimeMs"): histogram(7, 12, 30)}), before)
    assert busy["EndTxn_count"] == 2
    assert busy["EndTxn_mean_ms"] == 17.0
    assert busy["EndTxn_max_ms"] == 30.0


def test_jvm_pauses_and_compilation_are_differences_in_seconds() -> None:
    perf = {"sun.os.hrt.frequency": 1e9, "sun.rt.safepoints": 10,
            "sun.rt.safepointTime": 2e9, "sun.rt.safepointSyncTime": 1e8}
    before = Snapshot(0, {PERF: perf, YOUNG: {"CollectionCount": 3, "CollectionTime": 120},
                          "java.lang:type=Compilation": {"TotalCompilationTime": 5_000}})
    after = Snapshot(0, {
        PERF: {**perf, "sun.rt.safepoints": 25, "sun.rt.safepointTime": 3.25e9,
               "sun.rt.safepointSyncTime": 4e8},
        YOUNG: {"CollectionCount": 7, "CollectionTime": 200},
        "java.lang:type=Compilation": {"TotalCompilationTime": 18_400}})
    got = figures(after, before)
    assert (got["safepoints"], got["safepoint_s"], got["safepoint_sync_s"]) == (15, 1.25, 0.3)
    assert (got["gc_young_count"], got["gc_young_s"]) == (4, 0.08)
    assert (got["gc_old_count"], got["gc_old_s"]) == (0, 0.0)
    assert got["jit_s"] == 13.4


def test_thread_cpu_is_summed_by_group_and_a_thread_gone_counts_nothing() -> None:
    before = Snapshot(0, {THREAD_CPU: {
        "kafka-log-cleaner-thread-N": 1e9, "data-plane-kafka-request-handler-N": 4e9,
        "data-plane-kafka-network-thread-N-ListenerName(PLAINTEXT)-PLAINTEXT-N": 1e9,
        "kafka-scheduler-N": 5e9}})
    after = Snapshot(0, {THREAD_CPU: {
        "kafka-log-cleaner-thread-N": 3.5e9, "data-plane-kafka-request-handler-N": 4.25e9,
        "data-plane-kafka-network-thread-N-ListenerName(PLAINTEXT)-PLAINTEXT-N": 1.5e9,
        "kafka-scheduler-N": 2e9, "new-thread": 0.5e9}})
    got = figures(after, before)
    assert (got["cpu_cleaner_s"], got["cpu_handlers_s"], got["cpu_network_s"]) == (
        2.5, 0.25, 0.5)
    assert got["cpu_java_s"] == 3.75  # the scheduler's threads ended: 0, not -3


def test_a_reader_line_parses_and_a_broken_one_says_what_it_was() -> None:
    line = orjson.dumps({"t_ms": 12, "beans": {FETCH.format("LocalTimeMs"): {"Count": 3}}})
    assert parse(line.decode()) == Snapshot(12.0, {FETCH.format("LocalTimeMs"): {"Count": 3.0}})
    with pytest.raises(ValueError, match="unreadable broker metrics line"):
        parse('{"t_ms": 1}')
    with pytest.raises(ValueError, match="unreadable"):
        parse("Exception in thread main")


def test_a_failed_read_becomes_the_rows_note() -> None:
    good = Snapshot(0, {})
    assert between("broker metrics reader gave no answer", good) == {
        "note": "broker metrics reader gave no answer"}
    assert between(good, "no java on PATH") == {"note": "no java on PATH"}


def test_without_a_broker_pid_the_reader_says_so_and_starts_nothing() -> None:
    reader = broker_metrics.Reader(None)
    assert reader.read() == "no broker pid: not a broker tools/kafka runs"
    reader.close()
