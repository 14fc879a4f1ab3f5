"""CPU time of the processes in a run, from ``/proc``: was anything starved?

On two cores the bench's own producer and collector share the machine with
the service and the broker. Two figures per process tell a stall in the
service from starvation: CPU seconds used (``utime + stime`` of
``/proc/<pid>/stat``, all threads) and seconds spent runnable but waiting for
a core (the run-queue wait, field 2 of ``/proc/<pid>/task/<tid>/schedstat``,
summed over the threads). The busiest thread by name (``rdk:broker1``, a
librdkafka broker thread; ``kdelay``, the service's main thread) says where a
process's CPU went. The machine's own split
(``/proc/stat``: busy, idle, stolen by the hypervisor) shows whether the
cores were saturated, and the kernel's pressure stall figures
(``/proc/pressure/io``: seconds in which some, or all, runnable tasks waited
on I/O) with the kilobytes written to disk (``pgpgout`` of ``/proc/vmstat``)
whether a stall was the disk's. Nothing here needs psutil; a process that
has gone is simply left out, and a kernel without pressure figures leaves
them out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import TypeVar

from kdelay_bench.report import Figure

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Usage:
    """CPU seconds a process used, seconds its threads waited for a core (summed over
    threads, so it may exceed the wall time), and its busiest thread ("name 1.23s")."""

    cpu_s: float
    wait_s: float
    busiest: str = ""


@dataclass(frozen=True, slots=True)
class Machine:
    """Seconds of all cores together: busy, idle (with I/O wait) and stolen."""

    busy_s: float
    idle_s: float
    steal_s: float

    def minus(self, before: Machine) -> Machine:
        """Return the split between ``before`` and this reading."""
        return _between(self, before)


def stat_cpu_s(stat: str) -> float:
    """Return ``utime + stime`` in seconds from one ``/proc/<pid>/stat`` line.

    The command name (field 2) may hold spaces and parentheses, so the fields
    are counted from the last ``)``.
    """
    fields = stat.rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) * TICK_S


def schedstat_wait_s(schedstat: str) -> float:
    """Return the run-queue wait in seconds from one ``schedstat`` line (ns, field 2)."""
    return int(schedstat.split()[1]) / 1e9


def machine_split(stat_line: str) -> Machine:
    """Return the machine's split from the ``cpu`` line of ``/proc/stat``.

    Fields: user nice system idle iowait irq softirq steal (guest time is
    already inside user).
    """
    user, nice, system, idle, iowait, irq, softirq, steal = (
        int(x) for x in stat_line.split()[1:9])
    busy = user + nice + system + irq + softirq
    return Machine(busy * TICK_S, (idle + iowait) * TICK_S, steal * TICK_S)


@dataclass(frozen=True, slots=True)
class Thread:
    """One thread read at one moment: its name, CPU seconds and run-queue wait."""

    name: str
    cpu_s: float
    wait_s: float


def _read_thread(task: Path) -> Thread | None:
    try:
        return Thread((task / "comm").read_text().strip(),
                      stat_cpu_s((task / "stat").read_text()),
                      schedstat_wait_s((task / "schedstat").read_text()))
    except (OSError, IndexError, ValueError):
        return None  # the thread ended, or the kernel keeps no schedstat


@dataclass(frozen=True, slots=True)
class Reading:
    """One process read at one moment: CPU seconds and its threads by id."""

    cpu_s: float
    threads: dict[str, Thread]

    def since(self, before: Reading) -> Usage:
        """Return the usage since ``before``. Threads born since count from zero;
        those that ended are missing from the waits (the CPU total has them)."""
        zero = Thread("", 0.0, 0.0)
        wait = sum(t.wait_s - before.threads.get(tid, zero).wait_s
                   for tid, t in self.threads.items())
        return Usage(self.cpu_s - before.cpu_s, wait, self._busiest(before))

    def _busiest(self, before: Reading) -> str:
        """Return the thread that used the most CPU since ``before``: "name 1.23s"."""
        zero = Thread("", 0.0, 0.0)
        used = [(t.cpu_s - before.threads.get(tid, zero).cpu_s, t.name)
                for tid, t in self.threads.items()]
        if not used:
            return ""
        cpu, name = max(used)
        return f"{name} {cpu:.2f}s"


def read_process(pid: int) -> Reading | None:
    """Read process ``pid`` now; None when it has gone."""
    try:
        cpu = stat_cpu_s((PROC / str(pid) / "stat").read_text())
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return None
    threads = {task.name: thread for task in tasks if (thread := _read_thread(task))}
    return Reading(cpu, threads)


def own_cpu_s() -> float:
    """Return the user + system seconds this process has used, all threads: what
    ``/proc/self/stat`` holds, from the process CPU clock (nanoseconds, where
    ``os.times`` counts clock ticks)."""
    return time.process_time()


@dataclass(frozen=True, slots=True)
class Disk:
    """Seconds some / all runnable tasks stalled on I/O, and kilobytes written to disk."""

    io_some_s: float
    io_full_s: float
    written_kb: int

    def minus(self, before: Disk) -> Disk:
        """Return the figures between ``before`` and this reading."""
        return _between(self, before)


_Counters = TypeVar("_Counters", Machine, Disk)


def _between(after: _Counters, before: _Counters) -> _Counters:
    """The figures between two readings of the same counters, field by field."""
    return type(after)(*(a - b for a, b in zip(astuple(after), astuple(before), strict=True)))


def pressure_totals(text: str) -> tuple[float, float]:
    """Return the (some, full) stall seconds of one ``/proc/pressure/*`` file.

    Lines: ``some avg10=0.00 avg60=0.00 avg300=0.00 total=<microseconds>``, then
    ``full ...`` (the kernel's cumulative stall time).
    """
    totals = {line.split()[0]: int(line.rsplit("total=", 1)[1])
              for line in text.splitlines() if "total=" in line}
    return totals.get("some", 0) / 1e6, totals.get("full", 0) / 1e6


def vmstat_value(text: str, name: str) -> int:
    """Return counter ``name`` of ``/proc/vmstat`` (0 when the kernel has none)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0


def read_disk() -> Disk | None:
    """Read the I/O pressure and the kilobytes written so far; None without PSI."""
    try:
        some, full = pressure_totals((PROC / "pressure" / "io").read_text())
        written = vmstat_value((PROC / "vmstat").read_text(), "pgpgout")
    except (OSError, ValueError, IndexError):
        return None
    return Disk(some, full, written)


def read_machine() -> Machine:
    """Read the machine's split now."""
    with (PROC / "stat").open() as stat:
        return machine_split(stat.readline())


class CpuMeter:
    """Measures named processes and the machine from creation to :meth:`figures`."""

    def __init__(self, pids: Mapping[str, int | None]) -> None:
        self._pids = {name: pid for name, pid in pids.items() if pid is not None}
        self._machine = read_machine()
        self._disk = read_disk()
        self._before = {name: read_process(pid) for name, pid in self._pids.items()}

    def figures(self, elapsed_s: float,
                others: Mapping[str, Usage] | None = None) -> dict[str, Figure]:
        """Return ``<name>_cpu_s`` and ``<name>_wait_s`` per process since creation,
        plus ``others`` (processes that measured themselves, e.g. the collector), the
        machine's busy, idle and stolen seconds, and ``rest_cpu_s``: busy time no
        named process accounts for (other work on the machine, the kernel).
        Seconds are summed over cores: on two cores a window of ``elapsed_s``
        holds ``2 * elapsed_s`` of them."""
        used = dict(others or {})
        for name, pid in self._pids.items():
            before, after = self._before[name], read_process(pid)
            if before is not None and after is not None:
                used[name] = after.since(before)
        machine = read_machine().minus(self._machine)
        out: dict[str, Figure] = {"wall_s": round(elapsed_s, 2)}
        for name, usage in used.items():
            out[f"{name}_cpu_s"] = round(usage.cpu_s, 2)
            out[f"{name}_wait_s"] = round(usage.wait_s, 2)
            if usage.busiest:
                out[f"{name}_busiest_thread"] = usage.busiest
        out.update({"busy_s": round(machine.busy_s, 2), "idle_s": round(machine.idle_s, 2),
                    "steal_s": round(machine.steal_s, 2),
                    "rest_cpu_s": round(machine.busy_s - sum(u.cpu_s for u in used.values()),
                                        2)})
        disk = read_disk()
        if disk is not None and self._disk is not None:
            spent = disk.minus(self._disk)
            out.update({"io_some_s": round(spent.io_some_s, 2),
                        "io_full_s": round(spent.io_full_s, 2),
                        "disk_written_mb": round(spent.written_kb / 1024, 1)})
        return out
