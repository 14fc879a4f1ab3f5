"""Errors librdkafka reports outside any call: which are fatal, and how they are named."""

from __future__ import annotations

from confluent_kafka import KafkaError

from kdelay.callbacks import ClientErrors, fatal_code


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
