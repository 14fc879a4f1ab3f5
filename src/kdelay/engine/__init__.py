"""The delay service's engine: the loop that takes requests in and delivers them when due.

- :mod:`~kdelay.engine.service`: the loop, one step in one order for both
  guarantees, and partition assignment (:func:`~kdelay.engine.runner.run_service` runs it);
  :mod:`~kdelay.engine.factory` hands it its Kafka clients;
  :mod:`~kdelay.engine.outlook` its periodic round, and
  :mod:`~kdelay.engine.availability` whether Kafka answers (one line, one gauge per outage);
- :mod:`~kdelay.engine.workers`: ``kdelay run --workers N``, N service processes
  under a supervising parent (:func:`~kdelay.engine.runner.run_workers` runs them);
- :mod:`~kdelay.engine.commit`: how a step becomes durable, the only module
  that reads the guarantee; :mod:`~kdelay.engine.commit._transactional` the renewable
  transactional producer of exactly-once;
- :mod:`~kdelay.engine.intake`: requests to plans (index puts, cancels, DLQ records);
- :mod:`~kdelay.engine.delivery`: read-ahead, produce what is due, settle outcomes;
  :mod:`~kdelay.engine.delivery._book` keeps delivery's jobs and their states,
  :mod:`~kdelay.engine.delivery._readahead` how far each index was read ahead, and
  :mod:`~kdelay.engine.delivery._failures` what happens when a target fails;
- :mod:`~kdelay.engine.commit._writer`: the one changelog writer and its positions;
- :mod:`~kdelay.engine.outlook`, :mod:`~kdelay.engine.skew`,
  :mod:`~kdelay.engine.metrics`: forward-looking gauges, the broker's clock,
  the Prometheus metrics.

May import: :mod:`kdelay.protocol`, :mod:`kdelay.plumbing`, :mod:`kdelay.state`.
Never the CLI, the operator's view, the client helpers or Spark; nothing but
the CLI imports the engine.
"""
