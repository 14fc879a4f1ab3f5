"""Errors librdkafka reports outside any call: which are fatal, and how they are named."""

from __future__ import annotations

from confluent_kafka import KafkaError

from kdelay.plumbing.callbacks import ClientErrors, fatal_code


def test_only_the_first_fatal_error_is_kept_with_its_client() -> None:
    errors = ClientErrors()
    errors.callback("targets")(KafkaError(KafkaError._TRANSPORT, "broker down"))
    assert errors.take_fatal() is None
    fenced = KafkaError(KafkaError.PRODUCER_FENCED, "fenced", fatal=True)
    errors.callback("transactions")(fenced)
    errors.callback("intake")(KafkaError(KafkaError._FATAL, "later", fatal=True))
    assert errors.take_fatal() == ("transactions", fenced)


def test_a_fenced_member_or_producer_is_fenced_anything_else_fatal() -> None:
    assert fatal_code(KafkaError(KafkaError.FENCED_INSTANCE_ID, "x", fatal=True)) == "fenced"
    static = KafkaError(KafkaError._FATAL, "Fatal error: Broker: Static consumer fenced by "
                        "other consumer with same group.instance.id", fatal=True)
    assert fatal_code(static) == "fenced"
    assert fatal_code(KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, "x",
                                 fatal=True)) == "kafka-fatal"


class Lines:
    """A librdkafka ``logger`` that keeps what it is handed."""

    def __init__(self) -> None:
        self.lines: list[tuple[object, ...]] = []

    def log(self, level: int, message: str, *args: object) -> None:
        self.lines.append(args if args else (level, message))


def test_every_broker_down_makes_kafka_unreachable_until_it_answers() -> None:
    errors = ClientErrors()
    errors.callback("restore", watch=False)(KafkaError(KafkaError._ALL_BROKERS_DOWN, "old"))
    assert errors.unreachable() is None
    errors.callback("intake")(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    errors.callback("targets")(KafkaError(KafkaError._ALL_BROKERS_DOWN, "later"))
    assert errors.unreachable() == "intake: 1/1 brokers are down"
    errors.reachable()
    assert errors.unreachable() is None


def test_connection_failures_are_dropped_during_an_outage_and_rare_otherwise() -> None:
    errors = ClientErrors()
    lines = Lines()
    logger = errors.quiet(lines)
    logger.log(40, "%s [%s] %s", "FAIL", "c", "refused")
    logger.log(40, "%s [%s] %s", "FAIL", "c", "refused again, within the minute")
    errors.callback("intake")(KafkaError(KafkaError._ALL_BROKERS_DOWN, "down"))
    logger.log(40, "%s [%s] %s", "FAIL", "c", "during the outage")
    logger.log(30, "%s [%s] %s", "SESSTMOUT", "c", "other lines pass")
    assert lines.lines == [("FAIL", "c", "refused"), ("SESSTMOUT", "c", "other lines pass")]


def test_a_client_replaced_by_another_of_its_name_does_not_say_its_failure_again() -> None:
    """A renewed target producer connects to the same broker that is down: the line its
    predecessor passed within the minute stands for it too; another client still says its own."""
    errors = ClientErrors()
    lines = Lines()
    errors.quiet(lines, "targets").log(40, "%s [%s] %s", "FAIL", "targets", "refused")
    errors.quiet(lines, "targets").log(40, "%s [%s] %s", "FAIL", "targets", "refused, new one")
    errors.quiet(lines, "internal").log(40, "%s [%s] %s", "FAIL", "internal", "refused")
    assert lines.lines == [("FAIL", "targets", "refused"), ("FAIL", "internal", "refused")]


def test_a_renewable_client_latches_only_a_fence() -> None:
    errors = ClientErrors()
    on_error = errors.callback("transactions", renewable=True)
    on_error(KafkaError(KafkaError.INVALID_TXN_STATE, "after an outage", fatal=True))
    assert errors.take_fatal() is None
    fenced = KafkaError(KafkaError.PRODUCER_FENCED, "fenced", fatal=True)
    on_error(fenced)
    assert errors.take_fatal() == ("transactions", fenced)


def test_a_session_timeout_in_a_clients_log_is_noted_for_a_minute() -> None:
    now = [100.0]
    errors = ClientErrors(lambda: now[0])
    logger = errors.quiet(Lines())
    assert not errors.session_lost_lately()
    logger.log(30, "%s [%s] %s", "SESSTMOUT", "intake", "Consumer group session timed out")
    assert errors.session_lost_lately()
    now[0] += 59.0
    assert errors.session_lost_lately()
    now[0] += 2.0
    assert not errors.session_lost_lately()


def test_producer_id_retries_are_logged_once_a_minute() -> None:
    errors = ClientErrors()
    lines = Lines()
    logger = errors.quiet(lines)
    for _ in range(110):  # librdkafka retrying while a coordinator ends a transaction
        logger.log(4, "%s [%s] %s", "GETPID", "transactions", "CONCURRENT_TRANSACTIONS")
    logger.log(4, "%s [%s] %s", "FAIL", "transactions", "refused")
    assert lines.lines == [("GETPID", "transactions", "CONCURRENT_TRANSACTIONS"),
                           ("FAIL", "transactions", "refused")]


def test_a_new_brokers_coordinators_loading_is_said_once_as_info_whatever_the_clients() -> None:
    errors = ClientErrors()
    lines = Lines()
    first, second = errors.quiet(lines), errors.quiet(lines)
    loading = ("Failed to acquire idempotence PID from broker 127.0.0.1:9092/1: Broker: "
               "Coordinator load in progress: retrying")
    for logger in (first, second, first):
        logger.log(4, "%s [%s] %s", "GETPID", "internal", loading)
    first.log(4, "%s [%s] %s", "COMMITFAIL", "intake", "Coordinator load in progress")
    assert lines.lines == [(20, "waiting for the broker to load its group and transaction "
                                "coordinators (a new broker's first minute)")]
