"""The cluster the tests of this directory share: ``KDELAY_CLUSTER_BOOTSTRAP_SERVERS``
(``tools/test`` starts one and sets it), else ``tools/kafka cluster start``.

These tests stop and kill the cluster's nodes: never point them at a cluster
that others use.
"""

from __future__ import annotations

import os

import kafka_broker
import kafka_cluster
import pytest


@pytest.fixture(scope="session")
def cluster_bootstrap() -> str:
    """The bootstrap list of a three-node cluster run by ``tools/kafka cluster``."""
    try:
        return kafka_cluster.address()
    except kafka_broker.BrokerUnavailable as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"no Kafka cluster under CI: {exc}")
        pytest.skip(f"no Kafka cluster: {exc}")
