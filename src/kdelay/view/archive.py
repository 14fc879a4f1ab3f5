"""The export file: pending schedules with their original records, portable between clusters.

One UTF-8 JSON object per line (JSON lines), gzip-compressed when the file
name ends in ``.gz`` (reading sniffs the gzip magic instead of trusting the
name). Bytes (keys, values, header values) are base64; null stays null.

- line 1, the :class:`Header`: ``{"format": "kdelay-export", "version": 1,
  ...}`` names the format and its version, where the schedules come from and
  how many were pending when the export began;
- one :class:`Archived` per pending schedule: due time, target, target
  partition, id, key, value, user headers (every header but ``kdelay-*``),
  the request's coordinates (``origin``) and its timestamp, and its ``lane``
  when it named one (the field is left out otherwise);
- the last line, the :class:`Trailer`: ``{"end": true, "entries": N, ...}``.
  A file without it was cut short (an export that died, a partial copy).

Each line stands alone, so a reader and a writer hold one entry at a time
whatever the file's size. Decoding raises :class:`ArchiveError` with a stable
code and the line number; it never returns a half-checked entry.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import orjson

from kdelay.errors import KdelayError
from kdelay.protocol.envelope import LANE_NAME

FORMAT = "kdelay-export"
VERSION = 1
GZIP_MAGIC = b"\x1f\x8b"
PARTIAL_SUFFIX = ".partial"


class ArchiveError(KdelayError):
    """An export file that cannot be read; ``code`` is stable.

    ``bad-export-file`` (not JSON lines of this format, a field of the wrong
    type), ``export-version-unknown`` (written by a newer kdelay),
    ``export-truncated`` (no trailer: the file was cut short) or
    ``export-file-missing``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Header:
    """Where the schedules of a file come from.

    ``cluster_id`` is the source cluster's id (None if the broker did not say),
    ``pending`` the entries pending when the export began and
    ``latest_due_ms`` the latest due time among them (None when none was).
    """

    requests_topic: str
    cluster_id: str | None
    exported_ms: int
    pending: int
    latest_due_ms: int | None


@dataclass(frozen=True, slots=True)
class Archived:
    """One pending schedule and its original record.

    ``headers`` are the user's headers in order (``kdelay-*`` request headers
    are carried by the other fields); ``partition`` is the target partition the
    request asked for (None: the target's partitioner places the key);
    ``origin`` is ``topic/partition/offset`` of the request in the source;
    ``lane`` the request's ``kdelay-lane``, None without one.
    """

    due_ms: int
    target: str
    partition: int | None
    schedule_id: str | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    origin: str
    timestamp_ms: int
    lane: str | None = None


@dataclass(frozen=True, slots=True)
class Trailer:
    """The end of a file: entries written, and pending ones left out by why (``expired``...)."""

    entries: int
    unexported: dict[str, int] = field(default_factory=dict)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def encode_header(header: Header) -> bytes:
    """The first line of a file, newline included."""
    return orjson.dumps({
        "format": FORMAT, "version": VERSION, "requests_topic": header.requests_topic,
        "cluster_id": header.cluster_id, "exported_ms": header.exported_ms,
        "pending": header.pending, "latest_due_ms": header.latest_due_ms,
    }, option=orjson.OPT_APPEND_NEWLINE)


def encode_entry(entry: Archived) -> bytes:
    """One entry's line, newline included."""
    fields: dict[str, object] = {
        "due_ms": entry.due_ms, "target": entry.target, "partition": entry.partition,
        "id": entry.schedule_id, "key": _b64(entry.key), "value": _b64(entry.value),
        "headers": [[name, _b64(value)] for name, value in entry.headers],
        "origin": entry.origin, "timestamp_ms": entry.timestamp_ms,
    }
    if entry.lane is not None:
        fields["lane"] = entry.lane
    return orjson.dumps(fields, option=orjson.OPT_APPEND_NEWLINE)


def encode_trailer(trailer: Trailer) -> bytes:
    """The last line of a file, newline included."""
    return orjson.dumps({"end": True, "entries": trailer.entries,
                         "unexported": trailer.unexported}, option=orjson.OPT_APPEND_NEWLINE)


def _bad(number: int, detail: str) -> ArchiveError:
    return ArchiveError("bad-export-file", f"line {number}: {detail}")


def _get(obj: dict[str, Any], name: str, kind: type, number: int, *,
         nullable: bool = False) -> Any:
    """``obj[name]`` checked to be a ``kind`` (or None when ``nullable``); ArchiveError if not."""
    value = obj.get(name)
    if value is None and nullable and name in obj:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _bad(number, f"field {name!r} must be {kind.__name__}"
                           f"{' or null' if nullable else ''}, got {value!r:.60}")
    return value


def _bytes(obj: dict[str, Any], name: str, number: int) -> bytes | None:
    text = _get(obj, name, str, number, nullable=True)
    return None if text is None else _unb64(text, name, number)


def _unb64(text: str, name: str, number: int) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(number, f"field {name!r} is not base64") from None


def _object(line: bytes, number: int) -> dict[str, Any]:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise _bad(number, f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise _bad(number, "not a JSON object")
    return obj


def decode_header(line: bytes) -> Header:
    """Decode the first line; ArchiveError unless it names this format and a known version."""
    obj = _object(line, 1)
    if obj.get("format") != FORMAT:
        raise ArchiveError("bad-export-file", f"not a kdelay export file (line 1 names format "
                                              f"{obj.get('format')!r:.60}, not {FORMAT!r})")
    version = _get(obj, "version", int, 1)
    if version != VERSION:
        raise ArchiveError("export-version-unknown", f"export format version {version} is "
                           f"unknown to this kdelay (it reads version {VERSION}); "
                           "import with the kdelay version that wrote it or a newer one")
    return Header(_get(obj, "requests_topic", str, 1), _get(obj, "cluster_id", str, 1,
                                                            nullable=True),
                  _get(obj, "exported_ms", int, 1), _get(obj, "pending", int, 1),
                  _get(obj, "latest_due_ms", int, 1, nullable=True))


def decode_entry(obj: dict[str, Any], number: int) -> Archived:
    """Decode an entry's object (line ``number``); ArchiveError for a missing or mistyped field."""
    pairs = _get(obj, "headers", list, number)
    headers: list[tuple[str, bytes | None]] = []
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                and (pair[1] is None or isinstance(pair[1], str))):
            raise _bad(number, f"a header must be [name, base64 or null], got {pair!r:.60}")
        headers.append((pair[0], None if pair[1] is None else _unb64(pair[1], "headers",
                                                                     number)))
    return Archived(_get(obj, "due_ms", int, number), _get(obj, "target", str, number),
                 _get(obj, "partition", int, number, nullable=True),
                 _get(obj, "id", str, number, nullable=True), _bytes(obj, "key", number),
                 _bytes(obj, "value", number), headers, _get(obj, "origin", str, number),
                 _get(obj, "timestamp_ms", int, number), _lane(obj, number))


def _lane(obj: dict[str, Any], number: int) -> str | None:
    """The entry's optional lane; ArchiveError for one that is not a lane name."""
    if obj.get("lane") is None:
        return None
    lane = _get(obj, "lane", str, number)
    if LANE_NAME.fullmatch(lane) is None:
        raise _bad(number, f"field 'lane' is not a lane name, got {lane!r:.60}")
    return str(lane)


def decode_line(line: bytes, number: int) -> Archived | Trailer:
    """Decode an entry or the trailer (line ``number`` > 1); ArchiveError for anything else."""
    obj = _object(line, number)
    if obj.get("end") is True:
        unexported = _get(obj, "unexported", dict, number)
        return Trailer(_get(obj, "entries", int, number), unexported)
    return decode_entry(obj, number)


def is_gzip(path: Path) -> bool:
    """Whether ``path`` starts with the gzip magic bytes."""
    with path.open("rb") as raw:
        return raw.read(2) == GZIP_MAGIC


class ArchiveReader:
    """Reads an export file a line at a time: :attr:`header` at once, then :meth:`entries`.

    Raises :class:`ArchiveError` ``export-file-missing`` when ``path`` does
    not exist, and as the decoders do for its first line.
    """

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise ArchiveError("export-file-missing", f"no export file at {path}")
        self.path = path
        self._file = cast(IO[bytes], gzip.open(path, "rb") if is_gzip(path) else path.open("rb"))
        try:
            self.header = decode_header(self._first_line())
        except BaseException:
            self._file.close()
            raise
        self.trailer: Trailer | None = None

    def _first_line(self) -> bytes:
        try:
            return self._file.readline()
        except (OSError, EOFError) as exc:
            raise ArchiveError("bad-export-file", f"{self.path} cannot be read: {exc}") from None

    def entries(self) -> Iterator[Archived]:
        """Every entry in file order; then :attr:`trailer` is set.

        Raises ArchiveError ``export-truncated`` when the file ends without a
        trailer or with fewer entries than it counts, ``bad-export-file`` for
        a malformed line or anything after the trailer (entries before the bad
        line have been yielded by then).
        """
        count = 0
        try:
            for number, line in enumerate(self._file, start=2):
                if self.trailer is not None:
                    raise _bad(number, "a line after the end line")
                decoded = decode_line(line, number)
                if isinstance(decoded, Trailer):
                    self.trailer = decoded
                    continue
                count += 1
                yield decoded
        except (OSError, EOFError) as exc:
            raise ArchiveError("export-truncated", f"{self.path} is damaged or cut short "
                               f"after {count} entries: {exc}") from None
        self._check_end(count)

    def _check_end(self, count: int) -> None:
        if self.trailer is None:
            raise ArchiveError("export-truncated", f"{self.path} ends after {count} entries "
                               "without its end line: the export did not finish or the file "
                               "was cut short")
        if self.trailer.entries != count:
            raise ArchiveError("export-truncated", f"{self.path} holds {count} entries, its "
                               f"end line counts {self.trailer.entries}")

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class ArchiveWriter:
    """Writes an export file under ``<path>.partial``; :meth:`finish` renames it to ``path``.

    So a file at ``path`` is always complete: an export that fails leaves
    only the partial file, which :meth:`close` without :meth:`finish` deletes.
    Compressed with gzip (level 6) when ``path`` ends in ``.gz``.
    """

    def __init__(self, path: Path, header: Header) -> None:
        self.path = path
        self.header = header
        self._partial = path.with_name(path.name + PARTIAL_SUFFIX)
        raw = self._partial.open("wb")
        self._file = cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6)
                          if path.name.endswith(".gz") else raw)
        self._raw = raw
        self._count = 0
        self._done = False
        self._file.write(encode_header(header))

    def write(self, entry: Archived) -> None:
        """Append one entry."""
        self._file.write(encode_entry(entry))
        self._count += 1

    def finish(self, unexported: dict[str, int]) -> int:
        """Write the trailer, sync, and move the file into place; return the entries written."""
        self._file.write(encode_trailer(Trailer(self._count, unexported)))
        if self._file is not self._raw:
            self._file.close()  # the gzip stream's end; the raw file stays open
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        self._partial.replace(self.path)
        self._done = True
        return self._count

    def close(self) -> None:
        """Close; a file not finished is deleted."""
        if not self._done:
            self._file.close()
            self._raw.close()  # a gzip stream leaves it open
            self._partial.unlink(missing_ok=True)
