"""The console's copy of the changelog, kept in step, and a summary of it rebuilt aside.

:class:`Copy` holds the console's one :class:`~kdelay.view.pending.PendingView`
open for the console's life, with its memory bounded
(:class:`~kdelay.state.budget.StoreBudget`). Syncs take turns under its lock,
held only while a sync replays; reads of the synced stores (a record page, a
lookup, a list page) and a summary's build need no lock: RocksDB gives each
read a consistent state while a sync writes.

One daemon thread (:class:`Snapshots`) syncs the copy every ``interval_s``
(incremental: only what the changelog gained) and, when the sync replayed
anything, rebuilds the :class:`~kdelay.web.summary.Summary` the overview,
timeline and pending list count from, *aside*: a partition's new columns are
built while the screens go on counting the last summary, then swapped in, one
partition at a time (the summary's ``as of`` moves when the last is in). A
record page or a lookup asked during a rebuild never waits for it; at most for
a sync. Until the first summary is built the screens answer 503
``view-loading`` with the progress so far, so a console started on 10 M
pending says what it is doing instead of hanging.

A failed sync (Kafka away, the changelog unreadable) keeps the last summary
and says why in :attr:`Freshness.error`, once per failure, in the log too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kdelay.plumbing.clock import Clock
from kdelay.view.pending import Originals, PendingView
from kdelay.web.problems import Problem
from kdelay.web.summary import Builder, Columns, Summary

log = logging.getLogger(__name__)
INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class Freshness:
    """How current the console's copy is: ``as_of_ms`` of the summary (None before the
    first), entries read so far by a build under way (``loading``), the last failure."""

    as_of_ms: int | None
    loading: int | None
    error: str | None


M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter: how many heaps (arenas) threads may allocate from."""
ARENAS = 2
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter: blocks from this size on are mapped on their own."""
MAPPED_FROM = 256 * 1024


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def _give_back() -> None:
    """Return the heap a sync and a build freed to the system (glibc keeps it otherwise,
    and the console's resident size would stay at the build's peak)."""
    libc = _libc()
    trim = None if libc is None else getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _lean_heap() -> None:
    """Let the threads started from now on (librdkafka's, RocksDB's, the build's) share
    :data:`ARENAS` heaps, not glibc's eight a core, and map every block of
    :data:`MAPPED_FROM` or more on its own (fetch buffers, numpy temporaries), which
    frees it to the system at once: glibc would otherwise raise that threshold after
    the first such block and keep the later ones in heaps that hold what they freed.
    At 10 M pending the heaps held some 50 MB more than the console's work."""
    libc = _libc()
    options = None if libc is None else getattr(libc, "mallopt", None)
    if options is not None:
        options(M_ARENA_MAX, ARENAS)
        options(M_MMAP_THRESHOLD, MAPPED_FROM)


class Copy:
    """The console's view, opened by ``open_view`` (given the time) at the first sync and
    kept open until :meth:`close`; syncs take turns, reads need no lock."""

    def __init__(self, open_view: Callable[[int], PendingView]) -> None:
        self._open_view = open_view
        self._lock = threading.Lock()
        self._view: PendingView | None = None

    def synced(self, now_ms: int) -> tuple[PendingView, dict[int, int]]:
        """The view, caught up with the changelog as of ``now_ms``, and the records that
        sync replayed by partition. Waits only for a sync under way; raises what the
        view's sync raises (the view stays open, as it was)."""
        with self._lock:
            view = self._view
            if view is None:
                view = self._open_view(now_ms)
                try:
                    replayed = view.sync(now_ms)
                except BaseException:
                    view.close()
                    raise
                self._view = view
                return view, replayed
            return view, view.sync(now_ms)

    def close(self) -> None:
        """Close the view (after any sync under way)."""
        with self._lock:
            if self._view is not None:
                self._view.close()
                self._view = None


class Snapshots:
    """Keeps a summary of the copy current in a background thread (see the module).

    ``originals`` opens a reader of originals for a build.
    """

    def __init__(self, copy: Copy, originals: Callable[[], Originals], clock: Clock, *,
                 interval_s: float = INTERVAL_S) -> None:
        self._copy = copy
        self._originals = originals
        self._clock = clock
        self._interval_s = interval_s
        self._builder = Builder()
        self._summary: Summary | None = None
        self._loading: int | None = None
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The copy was synced by a read of its own since the summary was built: the next
        # refresh rebuilds even if its sync finds nothing new (the read replayed it).
        self._dirty = False

    def start(self) -> None:
        """Start the background thread (once)."""
        if self._thread is None:
            _lean_heap()
            self._thread = threading.Thread(target=self._run, name="kdelay-web-snapshots",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current step, then close the copy."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._copy.close()

    @property
    def freshness(self) -> Freshness:
        """How current the summary is."""
        summary = self._summary
        return Freshness(None if summary is None else summary.as_of_ms, self._loading,
                         self._error)

    def summary(self) -> Summary:
        """The latest summary; raises :class:`Problem` 503 ``view-loading`` before the first."""
        found = self._summary
        if found is None:
            read = self._loading or 0
            why = f" (last attempt failed: {self._error})" if self._error else ""
            raise Problem(503, "view-loading", f"the console is still reading its copy of the "
                          f"changelog: {read:,} pending entries so far{why}; try again shortly")
        return found

    def refresh(self) -> bool:
        """Sync the copy once and rebuild the summary aside when anything changed (or
        there is none yet); return whether it rebuilt. Raises what the sync raises."""
        now_ms = self._clock.now_ms()
        view, replayed = self._copy.synced(now_ms)
        current = self._summary
        if current is not None and not any(replayed.values()) and not self._dirty:
            self._summary = Summary(now_ms, current.routes, current.by_index)
            return False
        self._dirty = False
        self._loading = 0
        _give_back()  # what the sync freed (a first restore's, mostly), before the build
        try:
            with self._originals() as originals:
                self._rebuild(view, originals, now_ms)
            return True
        finally:
            self._loading = None
            _give_back()

    def _rebuild(self, view: PendingView, originals: Originals, now_ms: int) -> None:
        """Build each partition's columns aside; swap them in one partition at a time
        (all at once for the first summary), the ``as of`` last. What a partition's
        build freed is given back before the next one's (at 10 M pending, some 15 MB
        of the glibc heaps the build's reads churned)."""
        built: dict[int, Columns] = {}
        partitions = view.partitions
        for partition in partitions:
            columns = self._builder.partition(view, originals, partition, self._loaded)
            _give_back()  # the partition's temporaries, before the next one's build
            current = self._summary
            if current is None:
                built[partition] = columns
            else:
                self._summary = Summary(current.as_of_ms, tuple(self._builder.routes),
                                        {**current.by_index, partition: columns})
            del columns
        current = self._summary
        kept = built if current is None else {
            partition: columns for partition, columns in current.by_index.items()
            if partition in partitions}
        self._summary = Summary(now_ms, tuple(self._builder.routes), kept)

    def changed(self) -> None:
        """A read synced the copy itself and replayed records: they are not in the summary
        yet, and the next refresh must rebuild it."""
        self._dirty = True

    def _loaded(self, done: int) -> None:
        self._loading = (self._loading or 0) + done

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
                if self._error is not None:
                    log.warning("the console's copy is current again")
                self._error = None
            except Exception as exc:  # kept and shown; the next round retries
                if self._error is None:
                    log.warning("the console's copy could not be synced: %s", exc)
                self._error = str(exc) or type(exc).__name__
            self._stop.wait(self._interval_s)
