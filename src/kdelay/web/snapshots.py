"""The console's background copy: its view kept in step with the changelog, and a summary.

One daemon thread syncs the console's :class:`~kdelay.view.pending.PendingView`
every ``interval_s`` (incremental: only what the changelog gained) and, when
the sync replayed anything, rebuilds the :class:`~kdelay.web.summary.Summary`
the overview, timeline and pending list count from. Screens never wait for a
sync of their own; they show the summary's ``as of``. Until the first summary
is built they answer 503 ``view-loading`` with the progress so far, so a
console started on 10 M pending says what it is doing instead of hanging.

The thread takes the reads' lock while it syncs and builds (the view's stores
admit one reader), so a record or a list page asked during a rebuild waits for
it. A failed sync (Kafka away, the changelog unreadable) keeps the last summary
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
from kdelay.web.summary import Summary, summarize

log = logging.getLogger(__name__)
INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class Freshness:
    """How current the console's copy is: ``as_of_ms`` of the summary (None before the
    first), entries read so far by a build under way (``loading``), the last failure."""

    as_of_ms: int | None
    loading: int | None
    error: str | None


def _give_back() -> None:
    """Return the heap a sync and a build freed to the system (glibc keeps it otherwise,
    and the console's resident size would stay at the build's peak)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


class Snapshots:
    """Keeps a summary of the view current in a background thread.

    ``open_view`` opens the console's view (unsynced) and ``originals`` the
    reader of originals; both under ``lock``, held while syncing and building.
    """

    def __init__(self, open_view: Callable[[int], PendingView],
                 originals: Callable[[], Originals], lock: threading.Lock, clock: Clock, *,
                 interval_s: float = INTERVAL_S) -> None:
        self._open_view = open_view
        self._originals = originals
        self._lock = lock
        self._clock = clock
        self._interval_s = interval_s
        self._summary: Summary | None = None
        self._loading: int | None = None
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The view was synced by a read of its own since the summary was built: the next
        # refresh rebuilds even if its sync finds nothing new (the read replayed it).
        self._dirty = False

    def start(self) -> None:
        """Start the background thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kdelay-web-snapshots",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current step."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

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
        """Sync the view once and rebuild the summary when anything changed (or there is
        none yet); return whether it rebuilt. Raises what the view raises."""
        with self._lock:
            now_ms = self._clock.now_ms()
            view = self._open_view(now_ms)
            try:
                replayed = view.sync()
                current = self._summary
                if current is not None and not any(replayed.values()) and not self._dirty:
                    self._summary = Summary(now_ms, current.routes, current.by_index)
                    return False
                self._loading = 0
                self._dirty = False
                with self._originals() as originals:
                    self._summary = summarize(view, originals, now_ms, self._loaded)
                return True
            finally:
                self._loading = None
                view.close()
                _give_back()

    def changed(self) -> None:
        """A read synced the view itself and replayed records: they are not in the summary
        yet, and the next refresh must rebuild it (call with the lock held)."""
        self._dirty = True

    def _loaded(self, done: int) -> None:
        self._loading = done

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
