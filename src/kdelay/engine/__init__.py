"""The delay service's engine: the loop that takes requests in and delivers them when due.

A loop with two wings; docs/engine.md is the map (every module, a glossary,
the life of one entry), checked by ``tests/unit/test_layout.py``.

- The loop, flat here: :mod:`~kdelay.engine.service` (one step, one order
  for both guarantees; :mod:`~kdelay.engine.runner` runs it as ``kdelay
  run``, :mod:`~kdelay.engine.workers` as N processes),
  :mod:`~kdelay.engine.factory` (its Kafka clients),
  :mod:`~kdelay.engine.availability` (whether Kafka answers),
  :mod:`~kdelay.engine.intake` (requests to plans),
  :mod:`~kdelay.engine.sweeper` (tombstones of covered puts),
  :mod:`~kdelay.engine.outlook` (forward gauges, the housekeeping round),
  :mod:`~kdelay.engine.skew` (the broker's clock) and
  :mod:`~kdelay.engine.metrics`.
- :mod:`kdelay.engine.delivery`: read ahead, produce what is due, seal and
  settle it; its face is :class:`~kdelay.engine.delivery.Delivery`.
- :mod:`kdelay.engine.commit`: how a step becomes durable, the only wing
  that reads the guarantee; its face is the checkpoint.

Outside a wing, a module imports the wing's face, never its private modules;
neither wing imports the loop (the test above says so).

May import: :mod:`kdelay.protocol`, :mod:`kdelay.plumbing`, :mod:`kdelay.state`,
:mod:`kdelay.errors`. Never the CLI, the operator's view, the client helpers or
Spark; nothing but the CLI imports the engine.
"""
