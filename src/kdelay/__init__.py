"""kdelay: delayed and scheduled delivery for Apache Kafka.

Producers write the real record once to a retained requests topic; kdelay keeps
only ``due time -> (topic, partition, offset)`` and republishes the original
when it comes due.

What a producer-side user imports sits at the top of the package:
:mod:`kdelay.client` (``DelayProducer``: send and cancel), :mod:`kdelay.retry`
(consumer retries through kdelay), :mod:`kdelay.tasks` (scheduled tasks) and
:mod:`kdelay.recurring` (recurring series). They may import the protocol and
the plumbing, and each other; never the engine, the state or the view.

The rest lives in rooms, and imports run one way (``tests/unit/test_layout.py``
enforces it):

- :mod:`kdelay.protocol`: headers and byte layouts; imports nothing of kdelay;
- :mod:`kdelay.plumbing`: settings, Kafka clients, topics, identity, clock, logs;
- :mod:`kdelay.state`: the RocksDB index, the changelog, reads of the originals;
- :mod:`kdelay.engine`: the service loop, intake, delivery, checkpoints;
- :mod:`kdelay.view`: the operator's view (due, backlog, show, retention, stats);
- :mod:`kdelay.spark`: the cluster-wide Spark jobs (the ``spark`` extra);
- :mod:`kdelay.cli`: the ``kdelay`` command, one module per command group.
"""

__version__ = "0.1.0"

from kdelay import native as _native

# Before any module of the hot path is imported: compiled, or from its sources.
_native.choose()
