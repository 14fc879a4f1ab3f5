"""kdelay: delayed and scheduled delivery for Apache Kafka.

Producers write the real record once to a retained requests topic; kdelay keeps
only ``due time -> (topic, partition, offset)`` and republishes the original
when it comes due.
"""

__version__ = "0.1.0"
