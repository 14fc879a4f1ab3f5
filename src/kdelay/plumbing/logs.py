"""Log output of ``kdelay run``: plain text lines or JSON lines.

JSON lines carry ``time`` (UTC, ISO-8601 with milliseconds), ``level``,
``logger``, ``instance`` (the service's group member id, when known) and
``message``, plus ``exception`` (the formatted traceback) when the record has
one, so a log shipper can index them without a pattern. librdkafka's lines
come through loggers named ``kdelay.kafka.<client>``, so every line names both
the instance and the Kafka client. Text lines read
``<time> [<instance>] <LEVEL> <logger>: <message>`` (without the instance
part when none is known).
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from enum import StrEnum

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
INSTANCE_TEXT_FORMAT = "%(asctime)s [%(instance)s] %(levelname)s %(name)s: %(message)s"


class LogFormat(StrEnum):
    """How log records are written to stderr."""

    TEXT = "text"
    JSON = "json"


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        """Return the record as a JSON line (without the newline)."""
        line: dict[str, str] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
        }
        instance = getattr(record, "instance", None)
        if instance is not None:
            line["instance"] = str(instance)
        line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


class InstanceFilter(logging.Filter):
    """Stamps every record with the instance it comes from (``record.instance``)."""

    def __init__(self, instance: str) -> None:
        super().__init__()
        self.instance = instance

    def filter(self, record: logging.LogRecord) -> bool:
        """Add the instance; never drops a record."""
        record.instance = self.instance
        return True


def configure(level: str, log_format: LogFormat, instance: str | None = None) -> None:
    """Send the root logger's records at ``level`` and above to stderr in ``log_format``.

    With ``instance``, every line names it (a field of JSON lines, ``[instance]``
    after the time in text lines).
    Raises ValueError for an unknown level name.
    """
    handler = logging.StreamHandler(sys.stderr)
    text = TEXT_FORMAT if instance is None else INSTANCE_TEXT_FORMAT
    handler.setFormatter(JsonFormatter() if log_format is LogFormat.JSON
                         else logging.Formatter(text))
    if instance is not None:
        handler.addFilter(InstanceFilter(instance))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
