"""Cluster-wide data pipelines on Spark: the delivery audit (also by a table of ids), the
backlog forecast, and pending schedules to Parquet and back.

Everything under this package needs the ``spark`` extra (PySpark, matplotlib);
the rest of kdelay never imports it. The jobs read Kafka through Spark's own
Kafka source, whose jars :mod:`kdelay.spark.jars` finds or fetches, with
``read_committed`` and offsets pinned when the job starts (:mod:`kdelay.spark.source`).
"""
