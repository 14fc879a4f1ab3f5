"""The operator's view: what is pending, cluster-wide, while the service runs.

- :mod:`~kdelay.view.pending`: a local copy of the whole changelog, caught up
  incrementally, and reads of the originals it points at;
- :mod:`~kdelay.view.backlog`: ``due`` and ``backlog``;
  :mod:`~kdelay.view.lookup`: ``show``; :mod:`~kdelay.view.retention`: the
  retention check; :mod:`~kdelay.view.display`: their tables and JSON;
- :mod:`~kdelay.view.listing`: the console's filtered pages and timelines;
  :mod:`~kdelay.view.members`: which instances serve which partitions;
- :mod:`~kdelay.view.stats`: ``kdelay stats`` from running instances' metrics;
- :mod:`~kdelay.view.tail`: print records as they arrive on a topic;
- :mod:`~kdelay.view.deadletters`: the DLQ's latest records, and one read back
  to be sent again;
- :mod:`~kdelay.view.export`: ``export`` and ``import`` of pending schedules,
  in the file format of :mod:`~kdelay.view.archive`.

May import: :mod:`kdelay.protocol`, :mod:`kdelay.plumbing`, :mod:`kdelay.state`
and the client helpers (a series' description; import re-sends through the
client library). Never the engine: the view
reads what the engine persists, not how it runs.
"""
