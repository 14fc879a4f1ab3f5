"""What every room stands on: settings, Kafka clients and topics, identity, time, logs.

- :mod:`~kdelay.plumbing.settings`: the one typed settings object, built once;
  :mod:`~kdelay.plumbing.clientconfig` reads a Java ``client.properties`` into it;
- :mod:`~kdelay.plumbing.connection`: "does a broker answer", in seconds;
- :mod:`~kdelay.plumbing.clients`: the Kafka client protocols kdelay codes against,
  and the idioms around them (produce with a report, take a batch, watermarks);
- :mod:`~kdelay.plumbing.callbacks`: the latch for errors raised in librdkafka callbacks;
- :mod:`~kdelay.plumbing.topics`: kdelay's topics, their creation and layout checks;
- :mod:`~kdelay.plumbing.identity`: the ids an instance presents to Kafka;
- :mod:`~kdelay.plumbing.clock`: the injected clock (system and manual);
- :mod:`~kdelay.plumbing.logs`: text or JSON log lines.

May import: :mod:`kdelay.protocol`. Imported by every other room; it knows
nothing of the engine, the index, the view or the helpers.
"""
