"""CPU time of the processes in a run, from ``/proc``: was anything starved?

On two cores the bench's own producer and collector share the machine with
the service and the broker. Two figures per process tell a stall in the
service from starvation: CPU seconds used (``utime + stime`` of
``/proc/<pid>/stat``, all threads) and seconds spent runnable but waiting for
a core (the run-queue wait, field 2 of ``/proc/<pid>/task/<tid>/schedstat``,
summed over the threads alive at both readings). The machine's own split
(``/proc/stat``: busy, idle, stolen by the hypervisor) shows whether the
cores were saturated. Nothing here needs psutil; a process that has gone is
simply left out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kdelay_bench.report import Figure

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Usage:
    """CPU seconds a process used and seconds its threads waited for a core."""

    cpu_s: float
    wait_s: float

    def minus(self, before: Usage) -> Usage:
        """Return the usage between ``before`` and this reading."""
        return Usage(self.cpu_s - before.cpu_s, self.wait_s - before.wait_s)


@dataclass(frozen=True, slots=True)
class Machine:
    """Seconds of all cores together: busy, idle (with I/O wait) and stolen."""

    busy_s: float
    idle_s: float
    steal_s: float

    def minus(self, before: Machine) -> Machine:
        """Return the split between ``before`` and this reading."""
        return Machine(self.busy_s - before.busy_s, self.idle_s - before.idle_s,
                       self.steal_s - before.steal_s)


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


def _thread_waits(pid: int) -> dict[str, float]:
    waits = {}
    for task in (PROC / str(pid) / "task").iterdir():
        try:
            waits[task.name] = schedstat_wait_s((task / "schedstat").read_text())
        except (OSError, IndexError, ValueError):
            continue  # the thread ended, or the kernel keeps no schedstat
    return waits


@dataclass(frozen=True, slots=True)
class Reading:
    """One process read at one moment: CPU seconds and per-thread run-queue waits."""

    cpu_s: float
    waits: dict[str, float]

    def since(self, before: Reading) -> Usage:
        """Return the usage since ``before``, the waits over threads alive at both."""
        wait = sum(w - before.waits[t] for t, w in self.waits.items() if t in before.waits)
        return Usage(self.cpu_s - before.cpu_s, wait)


def read_process(pid: int) -> Reading | None:
    """Read process ``pid`` now; None when it has gone."""
    try:
        cpu = stat_cpu_s((PROC / str(pid) / "stat").read_text())
        return Reading(cpu, _thread_waits(pid))
    except OSError:
        return None


def read_machine() -> Machine:
    """Read the machine's split now."""
    with (PROC / "stat").open() as stat:
        return machine_split(stat.readline())


class CpuMeter:
    """Measures named processes and the machine from creation to :meth:`figures`."""

    def __init__(self, pids: Mapping[str, int | None]) -> None:
        self._pids = {name: pid for name, pid in pids.items() if pid is not None}
        self._machine = read_machine()
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
        out.update({"busy_s": round(machine.busy_s, 2), "idle_s": round(machine.idle_s, 2),
                    "steal_s": round(machine.steal_s, 2),
                    "rest_cpu_s": round(machine.busy_s - sum(u.cpu_s for u in used.values()),
                                        2)})
        return out
