"""Cluster-wide data pipelines on Spark: the delivery audit and the backlog forecast.

Everything under this package needs the ``spark`` extra (PySpark, matplotlib);
the rest of kdelay never imports it. The jobs read Kafka through Spark's own
Kafka source, whose jars :mod:`kdelay.spark.jars` finds or fetches, with
``read_committed`` and offsets pinned when the job starts (:mod:`kdelay.spark.source`).
"""
