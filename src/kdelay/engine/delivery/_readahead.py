"""Read-ahead: the entries delivery holds, read from the indexes before they are due.

Each partition's index is scanned (a bounded scan from where the last one
stopped, see :class:`~kdelay.engine.delivery._readahead.Window`) for entries due within
the look-ahead, and their originals are fetched as sorted offset ranges; what
comes back is held as :class:`~kdelay.engine.delivery._runs.Run` s, so that when an entry
comes due only a produce is left to do. :class:`ReadAhead` keeps the runs of
every partition, the run of every key it holds, and how far each index was read.

:class:`Window` is how far one partition's index was read ahead, and when to read it again.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Final

from confluent_kafka import KafkaError

from kdelay.engine.delivery._book import Book, Job, Sink, State
from kdelay.engine.delivery._controls import Controls, Shelf, Shelved
from kdelay.engine.delivery._flights import Flight
from kdelay.engine.delivery._runs import Run
from kdelay.protocol import codec
from kdelay.protocol.controls import Subject
from kdelay.state.changes import Entry
from kdelay.state.index import PartitionIndex, Scan
from kdelay.state.originals import Found, Reading

# A partition holds at most this many batches in memory, whatever their state.
MAX_HELD_BATCHES: Final = 20
AHEAD_BATCHES: Final = 4
"""Batches of a partition that may wait, read ahead, to be sent. More than one: a
burst's originals are fetched during the look-ahead, before they are due, rather
than a batch a step after, and each dispatch sends several batches at once."""


class ReadAhead:
    """The runs delivery holds, per partition and by key, and its read-ahead windows.

    Holds at most :data:`AHEAD_BATCHES` of ``batch_size`` entries waiting to be sent
    per partition (but adopted ones) and at most :data:`MAX_HELD_BATCHES` batches in all; the
    ``book``'s jobs count against both.
    """

    def __init__(self, reader: Reading, book: Book, lookahead_ms: int,
                 batch_size: int, controls: Controls | None = None,
                 lanes: Mapping[str, str] | None = None) -> None:
        self._reader = reader
        self._book = book
        self.controls = Controls() if controls is None else controls
        self._lanes: Mapping[str, str] = lanes or {}
        # The records scans leave in the index for now (see Shelf), as of the last read.
        self.shelf: Shelf | None = None
        self._lookahead_ms = lookahead_ms
        self.batch_size = batch_size
        self.runs: dict[int, list[Run]] = {}
        # The run of every entry held in a run and not settled, by key.
        self.held: dict[bytes, Run] = {}
        self.windows: dict[int, Window] = {}

    def take_out(self, run: Run, at: int, flight: Flight | None = None,
                 refused: KafkaError | None = None) -> Job:
        """Move the entry at ``at`` out of its run into the book, as a job of its own.

        With ``refused`` its produce was refused (or its target is missing): it
        is in flight until the flight lands, then backs off for a retry.
        Otherwise the book decides: held back while a cancel withholds it, or
        verified and dead-lettered when its original is not the one indexed.
        """
        key = run.keys[at]
        run.take(at)
        self.held.pop(key, None)
        raw = run.values[at]
        job = Job(Entry(key, codec.decode_index_value(raw), raw), run.originals[at],
                  run.partition, indexed=run.in_index(at))
        self._book.hold(job)
        if refused is not None and flight is not None:
            self._book.move(job, State.IN_FLIGHT)
            flight.jobs.append((job, Sink.TARGET))
            flight.refused(key, Sink.TARGET, refused.str())
        return job

    def hold_back(self, job: Job, subject: Subject) -> None:
        """Keep the book's ``job`` pending, held back by the control of ``subject``: it
        stays in the index and the changelog, untouched, until the control lets it go."""
        job.held_by = subject
        self._book.move(job, State.HELD)
        self.controls.hold(subject, job.key)

    def window(self, partition: int) -> Window:
        """The read-ahead window of ``partition`` (a new one at first)."""
        window = self.windows.get(partition)
        if window is None:
            window = self.windows[partition] = Window()
        return window

    def read(self, indexes: Mapping[int, PartitionIndex], now: int) -> None:
        """Scan each index whose window needs it, and fetch the originals of what it finds."""
        horizon = now + self._lookahead_ms
        shelf = self._shelve()
        wanted: dict[int, Scan] = {}
        # A plain dict when the book is empty (a burst): its ``in`` runs in C.
        skip: Container[bytes] = (_Held(self.held, self._book.keys) if self._book.held_total()
                                  else self.held)
        for partition, index in indexes.items():
            window = self.window(partition)
            if window.needs_scan(now, self._lookahead_ms):
                room = self.room(partition)
                if room <= 0:
                    continue
                if shelf is not None:
                    shelf.counting(window.shelf)
                scan = index.scan_raw(horizon, room, skip=skip, start=window.cursor,
                                      shelved=shelf)
                if scan.shelf_first:
                    window.shelve(scan.shelf_first)
                    window.shelf.passed(scan.shelf_last)
                last = max(scan.keys[-1] if scan.keys else b"", scan.shelf_last)
                if last:
                    # Everything below the last key read is held, shelved or gone: the
                    # next scan resumes right after it instead of walking the held keys.
                    window.cursor = codec.key_after(last)
                if scan.keys:
                    wanted[partition] = scan
                window.covered = horizon
                window.truncated = len(scan.keys) >= room
        if wanted:
            self._fetch(wanted)

    def _shelve(self) -> Shelf | None:
        """Update :attr:`shelf` from the controls; when a subject leaves it, every
        window that shelved records goes back to the first of them."""
        shelf = self.controls.shelf(self._lanes) if self.controls else None
        was = self.shelf
        if was is not None and (shelf is None or was.subjects - shelf.subjects):
            for window in self.windows.values():
                window.unshelve()
        self.shelf = shelf
        return shelf

    def forgot(self, keys: list[bytes]) -> None:
        """Entries left the index by other means (a cancel): count out shelved ones."""
        held, book = self.held, self._book.keys
        shelving = [window for window in self.windows.values() if window.shelved is not None]
        if not shelving:
            return
        for key in keys:
            if key in held or key in book:
                continue
            for window in shelving:
                if window.shelved is not None and window.shelved <= key < window.shelf.to:
                    window.shelf.forgot(key)
                    break

    def shelved(self) -> dict[bytes, tuple[int, bytes]]:
        """Per target (UTF-8), how many due records scans left in the index for a
        control, and the smallest key of them."""
        found: dict[bytes, tuple[int, bytes]] = {}
        for window in self.windows.values():
            shelf = window.shelf
            for target, count in shelf.counts.items():
                first = shelf.first[target]
                total, lowest = found.get(target, (0, first))
                found[target] = (total + count, min(lowest, first))
        return found

    def room(self, partition: int) -> int:
        """Return how many more entries of ``partition`` the read-ahead may take.

        Only entries waiting to be sent count against the batch: not those in
        flight or backing off (the next batch is read while the last one is
        acknowledged), nor those adopted from intake and not yet sent (they
        were never read, and under steady load with short delays they alone
        would fill the batch and stop the read-ahead). The cap on all held
        entries keeps memory bounded.
        """
        waiting = sum(len(run.keys) - run.sent for run in self.runs.get(partition, ())
                      if not run.adopted)
        waiting += self._book.count(partition, State.READY)
        return min(AHEAD_BATCHES * self.batch_size - waiting, self.cap(partition))

    def cap(self, partition: int) -> int:
        """Return how many more entries ``partition`` may hold in memory, whatever their state."""
        held = sum(len(run.keys) - run.settled for run in self.runs.get(partition, ()))
        return MAX_HELD_BATCHES * self.batch_size - held - self._book.held(partition)

    def _fetch(self, wanted: dict[int, Scan]) -> None:
        """Read the originals of the entries scanned and hold them as runs."""
        # An original lies on the partition its key names (another for a forwarded id).
        offsets: dict[int, list[int]] = {}
        # Each scan's keys decoded flat, and the one partition their originals lie on
        # (all but forwarded ids), None when they lie on several.
        decoded: dict[int, tuple[list[int], int | None]] = {}
        for partition, scan in wanted.items():
            fields = codec.due_key_fields(b"".join(scan.keys))
            lies = fields[1::3]
            one = lies[0] if lies.count(lies[0]) == len(lies) else None
            decoded[partition] = fields, one
            if one is not None:
                offsets.setdefault(one, []).extend(fields[2::3])
            else:
                for where, offset in zip(lies, fields[2::3], strict=True):
                    offsets.setdefault(where, []).append(offset)
        originals = self._reader.read(offsets)
        for partition, (keys, values, gapless, puts_seen, _, _) in wanted.items():
            fields, one = decoded[partition]
            found_all = _found(fields, one, originals)
            cut = len(found_all)
            if cut < len(keys):  # unresolved: the run stops before the first of them
                window = self.window(partition)
                window.covered = None
                window.rewind(keys[cut])
                del keys[cut:], values[cut:], fields[3 * cut:]
            if keys:  # a cut run is still gapless: it holds a prefix of what was read
                self.hold(Run(partition, keys, values, found_all, gapless=gapless,
                              puts_seen=puts_seen, fields=fields))

    def adopt(self, partition: int, keys: list[bytes], values: list[bytes],
              originals: list[Found]) -> None:
        """Hold entries intake adopted (sorted, not in the index yet): after the last
        adopted run of ``partition`` when they follow it and it has room (a steady rate
        adopts a few entries a step, due in the order they came), else as a run of their own."""
        runs = self.runs.get(partition)
        last = runs[-1] if runs else None
        if (last is not None and last.adopted and len(last.keys) < self.batch_size
                and last.keys[-1] < keys[0]):
            last.extend(keys, values, originals)
            held = self.held
            for key in keys:
                held[key] = last
        else:
            self.hold(Run(partition, keys, values, originals, adopted=True, indexed_to=0))

    def landed(self, partition: int) -> int:
        """Return how many entries of ``partition`` have landed and are not settled."""
        return sum(run.settles_to() - run.settled for run in self.runs.get(partition, ()))

    def indexed(self, keys: list[bytes]) -> list[bytes]:
        """Learn that the entries of ``keys`` are in the index now; return the keys of
        those not held in a run."""
        if not self.held:  # intake's entries due beyond the window: none is
            return keys
        runs: dict[int, tuple[Run, list[int]]] = {}
        rest: list[bytes] = []
        for key in keys:
            run = self.held.get(key)
            at = None if run is None else run.position(key)
            if run is None or at is None:
                rest.append(key)
            else:
                runs.setdefault(id(run), (run, []))[1].append(at)
        for run, positions in runs.values():
            run.indexed(positions)
        return rest

    def hold(self, run: Run) -> None:
        """Start holding ``run``: its entries wait for their due time."""
        self.runs.setdefault(run.partition, []).append(run)
        held = self.held
        for key in run.keys:
            held[key] = run

    def drop(self, partition: int) -> None:
        """Forget every run and the window of ``partition``."""
        for run in self.runs.pop(partition, []):
            for key in run.keys:
                if self.held.get(key) is run:
                    del self.held[key]
        self.windows.pop(partition, None)

    def settled(self, partition: int, runs: list[tuple[Run, int]]) -> int:
        """The ranges of ``runs`` up to each end are out of the index: stop holding
        them, and forget finished runs; return how many entries left (not taken out)."""
        held = self.held
        left = 0
        for run, landed in runs:
            if landed <= run.settled:
                continue
            for key in run.keys[run.settled:landed]:
                if held.get(key) is run:
                    del held[key]
            taken = run.taken
            left += landed - run.settled - (
                0 if not taken else sum(1 for at in taken if run.settled <= at < landed))
            run.settled = landed
        kept = [run for run in self.runs.get(partition, []) if not run.finished]
        if kept:
            self.runs[partition] = kept
        else:
            self.runs.pop(partition, None)
        return left

    def first_unsent(self) -> bytes | None:
        """The smallest key of every run not yet produced, None if none."""
        keys = [key for runs in self.runs.values() for run in runs
                if (key := run.unsent_key()) is not None]
        return min(keys, default=None)


def _found(fields: list[int], one: int | None,
           originals: dict[int, dict[int, Found]]) -> list[Found]:
    """The originals of the keys whose fields (see :func:`codec.due_key_fields`) are
    ``fields``, up to the first not resolved; ``one``: the partition every one lies on."""
    offsets = fields[2::3]
    if one is not None:
        try:  # every one resolved, looked up in C
            return list(map(originals[one].__getitem__, offsets))
        except KeyError:
            pass
    found_all: list[Found] = []
    for where, offset in zip(fields[1::3], offsets, strict=True):
        original = originals[where].get(offset)
        if original is None:
            break
        found_all.append(original)
    return found_all


class _Held(Container[bytes]):
    """The keys delivery holds, in runs or in the book: what a scan passes over."""

    __slots__ = ("_book", "_runs")

    def __init__(self, runs: Mapping[bytes, Run], book: Container[bytes]) -> None:
        self._runs = runs
        self._book = book

    def __contains__(self, key: object) -> bool:
        return key in self._runs or key in self._book

@dataclass(slots=True)
class Window:
    """How far delivery has read one partition's index ahead."""

    covered: int | None = None
    """Every entry due at or before this time is held or gone; None: scan again."""
    cursor: bytes | None = None
    """Where the next scan resumes: every key below it is held or gone."""
    truncated: bool = False
    """The last scan stopped at its limit: there may be more below ``covered``."""
    lowest_put: bytes | None = None
    """The smallest key put since the last scan, that delivery was not handed."""
    shelved: bytes | None = None
    """The smallest key a scan left in the index for a control (see Shelf): it and
    keys above it are not all held, whatever the cursor says."""
    shelf: Shelved = field(default_factory=Shelved)
    """What scans shelved since :attr:`shelved` was set, counted per target."""

    def needs_scan(self, now: int, lookahead_ms: int) -> bool:
        """Whether the index must be read again at ``now``: nothing read yet, the last scan
        was cut short, a key was put below what is covered, or half the look-ahead is used."""
        lowest, self.lowest_put = self.lowest_put, None
        if lowest is not None:
            self.rewind(lowest)
        covered = self.covered
        if covered is None or self.truncated:
            return True
        if lowest is not None and codec.decode_due_key(lowest).due_ms <= covered:
            return True
        return now + lookahead_ms // 2 >= covered

    def held_below(self) -> bytes | None:
        """Return a key below which every entry of the index is held by delivery or gone
        (None: not known, nothing was read yet).

        After a complete scan that is everything due by ``covered``: what was put
        since is adopted, or noted as ``lowest_put``. After a scan cut short, or
        a rewind, it is the cursor. Never above a key left on the shelf.
        """
        if self.covered is not None and not self.truncated:
            bound: bytes | None = codec.due_upper_bound(self.covered)
        else:
            bound = self.cursor
        for lowest in (self.lowest_put, self.shelved):
            if lowest is not None and (bound is None or lowest < bound):
                bound = lowest
        return bound

    def shelve(self, key: bytes) -> None:
        """A scan left ``key`` in the index for a control (see Shelf)."""
        if self.shelved is None or key < self.shelved:
            self.shelved = key

    def unshelve(self) -> None:
        """The records left in the index may be read now: scan again from the first."""
        if self.shelved is not None:
            self.rewind(self.shelved)
            self.shelved = None
            self.covered = None
            self.shelf = Shelved()

    def rewind(self, key: bytes) -> None:
        """Move the scan cursor back to ``key`` (an entry not held yet)."""
        if self.cursor is not None and key < self.cursor:
            self.cursor = key
