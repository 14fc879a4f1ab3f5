"""A partition's restore in a child process of its own, so that restores use every core.

One process restores at about 1.2 µs of CPU a changelog entry, most of it
under one interpreter lock (rocksdict's write holds it too): a thread gains
nothing, a process a core. Each partition has its own store directory, so a
child can replay one while the service serves the others and other children
replay theirs.

:class:`ChildReplay` is the parent's side: it closes the store, starts
``python -m kdelay.state.replayer`` (a fresh interpreter, never a fork of
the service's, whose librdkafka threads a fork would not carry), hands it the
task as JSON on its standard input and reads its report, a line at a time, on
its standard output: ``progress DONE ALL`` as it goes, then ``done APPLIED``
or ``error WHY``. The child (:func:`main`) opens the store, replays it with a
:class:`~kdelay.state.changelog.Restorer` of its own exactly as the service
would, and closes it. The parent opens the store again only once the child
said ``done`` and exited with status 0; the store then holds the whole replay,
flushed (:meth:`~kdelay.state.index.PartitionIndex.bulk`). A child that fails,
dies or is killed leaves what a crash of an in-process replay leaves: a
flushed prefix of its batches with the changelog offset they reach, which the
next restore carries on from. It dies with its parent (Linux), so that a
restarted service never finds a store held by an orphan.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, BinaryIO

import orjson

import kdelay
from kdelay.state.index import PartitionIndex
from kdelay.state.memory import MB, StoreMemory

log = logging.getLogger(__name__)

# The child store's RocksDB memory: its memtables take the bulk load, its cache
# serves only the replay's few lookups.
WRITE_BUFFER_BYTES = 64 * MB
CACHE_BYTES = 16 * MB
PR_SET_PDEATHSIG = 1
# How long a child that closed its output may take to exit before it is killed.
EXIT_WAIT_S = 5.0
Progress = Callable[[int, int], None]
# What the child runs: this module, in a fresh interpreter.
COMMAND = ("-m", "kdelay.state.replayer")


class ReplayFailed(Exception):
    """The child process ended without replaying the partition (its reason in the message)."""


def plain_config(config: Mapping[str, object]) -> dict[str, str | int | bool] | None:
    """The librdkafka settings of ``config`` a child can be handed as JSON, or None when
    one of its settings is not plain (a callback that makes its tokens, say)."""
    plain: dict[str, str | int | bool] = {}
    for key, value in config.items():
        if key in ("error_cb", "logger", "stats_cb", "throttle_cb"):
            continue  # the parent's reporting: the child reports on its own
        if not isinstance(value, str | int | bool):
            return None
        plain[key] = value
    return plain


class ChildReplay:
    """One partition's restore run by a child process (see the module).

    ``index`` is closed here and the store is the child's until it ends;
    :attr:`index` is the store opened again (on the same memory budget) once
    it is done. :meth:`advance` looks at the child's report; :meth:`close`
    kills a child still running.
    """

    detached = True

    def __init__(self, config: Mapping[str, str | int | bool], topic: str,
                 index: PartitionIndex, progress: Progress | None, stall_s: float) -> None:
        self.index = index
        self._progress = progress
        self.applied = 0
        self._done = False
        self._ended = False
        self._buffer = b""
        self._error = ""
        index.close()
        package = str(Path(kdelay.__file__).resolve().parent.parent)
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": package if not path else package + os.pathsep + path}
        self._process = subprocess.Popen(  # noqa: S603 - this interpreter, our module
            [sys.executable, *COMMAND], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env)
        task, out = self._process.stdin, self._process.stdout
        assert task is not None  # noqa: S101 - both are pipes
        assert out is not None  # noqa: S101
        self._out: IO[bytes] = out
        task.write(orjson.dumps({
            "config": dict(config), "topic": topic, "path": str(index.path),
            "partition": index.partition, "stall_s": stall_s, "parent": os.getpid()}))
        task.close()

    def __enter__(self) -> ChildReplay:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        """Whether the child has not ended yet."""
        return not self._ended

    def fileno(self) -> int:
        """The child's report pipe, for :func:`select.select` (readable: news or its end)."""
        return self._out.fileno()

    def advance(self, budget_s: float = math.inf) -> bool:
        """Read the child's report for up to ``budget_s`` seconds (0: only what is there);
        return whether it is done, :attr:`index` then open again.

        Raises :class:`ReplayFailed` when the child said it failed or ended
        without saying it was done; the store is then left closed.
        """
        until = time.monotonic() + budget_s
        while not self._ended:
            left = max(0.0, min(until - time.monotonic(), 1.0))
            if select.select([self._out], [], [], left)[0]:
                chunk = os.read(self._out.fileno(), 1 << 16)
                if not chunk:
                    self._end()
                    break
                self._read(chunk)
            elif time.monotonic() >= until:
                break
        return self._done

    def _read(self, chunk: bytes) -> None:
        """Take in the report lines in ``chunk`` (see the module)."""
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        for line in lines:
            kind, _, rest = line.decode("utf-8", "replace").partition(" ")
            if kind == "progress" and self._progress is not None:
                done, all_ = rest.split()
                self._progress(int(done), int(all_))
            elif kind == "done":
                self.applied = int(rest)
            elif kind == "error":
                self._error = rest

    def _end(self) -> None:
        """The child closed its output: reap it, and open the store if it is done."""
        self._reap()
        status = self._process.returncode
        if status != 0 or self._error:
            why = self._error or f"the process ended with status {status} before it was done"
            raise ReplayFailed(f"partition {self.index.partition}: {why}")
        self.index = PartitionIndex(self.index.path, self.index.partition, self.index.memory)
        self._done = True

    def _reap(self) -> None:
        """Wait for the child to exit, killing it if it does not soon."""
        self._ended = True
        try:
            self._process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._out.close()

    def close(self) -> None:
        """End the replay, done or not: a child still running is killed and its store
        left closed, as a crash would leave it."""
        if self._ended:
            return
        self._process.kill()
        self._reap()


def main(task: bytes, out: BinaryIO) -> int:
    """Run the restore ``task`` (see the module); return the process's exit status."""
    from kdelay.state.changelog import Restorer  # the changelog module imports this one

    spec = orjson.loads(task)
    die_with(int(spec["parent"]))
    partition = int(spec["partition"])
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s restore of partition {partition}: "
                               "%(message)s")

    def report(line: str) -> None:
        out.write(line.encode() + b"\n")
        out.flush()

    try:
        memory = StoreMemory(CACHE_BYTES, WRITE_BUFFER_BYTES)
        with Restorer(spec["config"], spec["topic"], timeout_s=float(spec["stall_s"])) as restorer:
            index = PartitionIndex(Path(spec["path"]), partition, memory)
            try:
                applied = restorer.restore(index, lambda done, all_: report(
                    f"progress {done} {all_}"))
            finally:
                index.close()
    except Exception as exc:  # reported to the parent, which says why it falls back
        report(f"error {type(exc).__name__}: {exc}".replace("\n", " "))
        return 1
    report(f"done {applied}")
    return 0


def die_with(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), and exit now if
    the parent is already gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.stdin.buffer.read(), sys.stdout.buffer))
