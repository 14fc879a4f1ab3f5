"""The operator's view: what is pending, cluster-wide, while the service runs.

- :mod:`~kdelay.view.pending`: a local copy of the whole changelog, caught up
  incrementally, and reads of the originals it points at;
- :mod:`~kdelay.view.backlog`: ``due`` and ``backlog``;
  :mod:`~kdelay.view.lookup`: ``show``; :mod:`~kdelay.view.retention`: the
  retention check; :mod:`~kdelay.view.display`: their tables and JSON;
- :mod:`~kdelay.view.stats`: ``kdelay stats`` from running instances' metrics;
- :mod:`~kdelay.view.tail`: print records as they arrive on a topic.

May import: :mod:`kdelay.protocol`, :mod:`kdelay.plumbing`, :mod:`kdelay.state`
and the client helpers (a series' description). Never the engine: the view
reads what the engine persists, not how it runs.
"""
