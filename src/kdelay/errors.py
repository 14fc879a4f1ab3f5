"""The root of kdelay's errors: every error a user or the cluster can cause has a stable code.

:class:`KdelayError` is what the CLI catches to print ``error[code]: message``
and exit (``kdelay.cli.options`` maps each kind to its exit status, in one
table); a library caller may catch it to handle every such error at once,
and match ``code`` rather than the message, which may change. Each room
keeps its own subclasses, next to the code that raises them
(:class:`~kdelay.plumbing.settings.SettingsError`,
:class:`~kdelay.plumbing.topics.LayoutError`,
:class:`~kdelay.client.DeliveryError`, ...); the engine's own is
:class:`ServiceError`, here because the loop, its runner and the checkpoint
all raise or catch it.

May import: nothing of kdelay. Every room may import it.
"""

from __future__ import annotations


class KdelayError(Exception):
    """An error with a stable ``code`` (kebab-case, such as ``bad-series``), which
    scripts and operators match on; the message says why and what to do."""

    code: str = "kdelay-error"
    """Set by each subclass, as a class attribute or per instance."""


class ServiceError(KdelayError):
    """The service cannot go on (its own topics refuse writes, it was fenced, it was
    stopped while Kafka was away); ``code`` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
