"""The state dir: where indexes live, the lock one process holds on it, and its room.

Every partition's index is a store under ``--state-dir``
(:func:`store_path`); a process locks the whole dir before it meets Kafka
(:class:`StateDirLock`), and a write that finds no room on the volume says so
with what is free (:class:`StateDirFull`), for an operator to act on.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

STATE_DIR_LOCK = "kdelay.lock"


class IndexLocked(Exception):
    """Another process (or object) holds the store open; it must not be touched."""


class StateDirFull(Exception):
    """The state dir's volume has no room left for a write; ``path`` and ``free_bytes`` say where.

    Nothing is lost: a write that failed is not applied, and the requests
    behind it are read again after a restart on a volume with room.
    """

    def __init__(self, path: Path, detail: str) -> None:
        self.path = path
        self.free_bytes = free_bytes(path)
        super().__init__(f"no space left on the volume of {path} ({self.free_bytes} bytes free): "
                         f"grow it or free space, then restart; nothing is lost ({detail})")


_NO_SPACE = ("no space left on device", "disk full", "enospc")


def free_bytes(path: Path) -> int:
    """Return the bytes free on ``path``'s volume (nearest existing ancestor); -1: unknown."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return -1


def no_space(exc: Exception) -> bool:
    """Whether ``exc`` says the volume has no room left."""
    text = str(exc).lower()
    return any(marker in text for marker in _NO_SPACE)


class StateDirLock:
    """The lock one process holds on a whole state dir, from before it meets Kafka to its exit.

    Every partition's store is locked by RocksDB too, but only once it is
    opened, after the consumer group assigned the partition: by then a second
    process started on the same state dir has joined the group under the same
    static member id (derived from the state dir, see :mod:`kdelay.plumbing.identity`)
    and fenced the first. This lock (``flock`` on ``<state dir>/kdelay.lock``,
    released by the kernel when the process dies, however it dies) is taken
    first. Raises :class:`IndexLocked` when another process (or another lock
    object) holds it.
    """

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / STATE_DIR_LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise IndexLocked(f"state dir {state_dir} is in use by another process "
                              f"({path} is locked)") from exc
        self._fd: int | None = fd

    def release(self) -> None:
        """Release the lock (once; later calls do nothing)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def store_path(state_dir: Path, requests_topic: str, partition: int) -> Path:
    """Return where the index of one request partition lives under ``state_dir``."""
    return state_dir / f"{requests_topic}-{partition}"
