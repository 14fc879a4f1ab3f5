"""The protocol: what producers write and what kdelay persists, as bytes.

- :mod:`~kdelay.protocol.envelope`: the request headers (``kdelay-target``,
  ``kdelay-due-ms`` ...), their parsing into a schedule, a cancel or a rejection
  with a stable error code, and the headers of a delivered record;
- :mod:`~kdelay.protocol.durations`: durations (``30s``, ``2h``), the delay-level
  table, and how far ahead a due time may lie (the requests topic's retention);
- :mod:`~kdelay.protocol.targets`: which topics a request may target;
- :mod:`~kdelay.protocol.forward`: the record that sends a request with an id on
  to the id's partition, and that partition (:func:`~kdelay.protocol.forward.id_partition`);
- :mod:`~kdelay.protocol.codec`: every byte layout kdelay persists (due keys,
  index values, fingerprints, changelog keys), as encode/decode pairs;
- :mod:`~kdelay.protocol.idkeys`: schedule ids as kdelay keys them (unique within
  their lane), and the outcome record of a request with an id.

May import: nothing else of kdelay. Everything else may import it. A change
here is a change of the wire or the disk format.
"""
