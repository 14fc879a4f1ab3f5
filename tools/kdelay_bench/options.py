"""Command-line options of ``tools/bench``: sizes, durations and outputs.

Sizes left unset take the default of the chosen mode: the full run (issue 5's
sizes), ``--quick`` (the whole run in well under five minutes on two cores) or
``--long`` (full sizes plus the 10 M pending capacity run).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

SCENARIOS = ("floor", "pipe", "intake", "burst", "lateness", "catchup", "footprint", "restore",
             "capacity", "operator", "spark", "transfer", "console", "campaign")
OPT_IN = ("capacity", "spark", "transfer", "console", "campaign")
GUARANTEES = ("at-least-once", "exactly-once")

# name -> (full default, quick default)
SIZES: dict[str, tuple[float, float]] = {
    "intake_records": (500_000, 100_000),
    "burst_records": (1_000_000, 60_000),
    "lateness_seconds": (60, 10),
    "lateness_runs": (5, 1),
    "footprint_entries": (1_000_000, 200_000),
    "restore_entries": (1_000_000, 300_000),
    "capacity_pending": (100_000_000, 1_000_000),
    "capacity_base": (1_000_000, 100_000),
    "operator_pending": (1_000_000, 100_000),
    "spark_requests": (1_000_000, 100_000),
    "transfer_pending": (1_000_000, 100_000),
    "console_pending": (1_000_000, 100_000),
    "catchup_records": (20_000, 5_000),
    "campaign_rows": (1_000_000, 100_000),
}
# With --long the operator scenario runs again at this size.
OPERATOR_LONG_PENDING = 10_000_000


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """Everything one benchmark run is configured with."""

    bootstrap_servers: str | None
    scenarios: tuple[str, ...]
    quick: bool
    partitions: int
    value_size: int
    batch_size: int
    pipe_repeats: int
    intake_records: int
    burst_records: int
    lateness_rate: int
    lateness_seconds: float
    lateness_warmup_seconds: float
    lateness_delay_ms: int
    lateness_drain_seconds: float
    lateness_runs: int
    fresh_broker: bool
    fresh_broker_wait: float
    guarantees: tuple[str, ...]
    footprint_entries: int
    footprint_values: tuple[int, ...]
    restore_entries: int
    capacity_pending: int
    capacity_base: int
    operator_pending: tuple[int, ...]
    spark_requests: int
    transfer_pending: int
    console_pending: int
    json_path: Path | None
    markdown_path: Path | None
    work_dir: Path | None
    keep_topics: bool
    ids: bool = False
    charts_dir: Path | None = None
    peer: Path | None = None
    burst_lead_s: float | None = None
    catchup_records: int = 20_000
    catchup_rate: int = 2_000
    campaign_rows: int = 1_000_000


def _names(text: str) -> tuple[str, ...]:
    """Split a comma-separated list of names."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _ints(text: str) -> tuple[int, ...]:
    """Split a comma-separated list of integers."""
    return tuple(int(item) for item in _names(text))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/bench", description="Measure kdelay against a plain consume-produce "
        "pipe and a payload-copy store, on the local broker (see docs/benchmarks.md).")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes: under 5 minutes")
    mode.add_argument("--long", action="store_true",
                      help="also run capacity, and operator at 10 M pending")
    p.add_argument("--bootstrap-servers", help="broker to use (default: "
                   "KDELAY_BOOTSTRAP_SERVERS, else `tools/kafka start`)")
    p.add_argument("--scenarios", type=_names,
                   help=f"comma list of {','.join(SCENARIOS)} (the pipe-tombstone baseline "
                   "runs with burst, the hop baseline with lateness; capacity, spark, transfer, "
                   "console and campaign run only when named, or capacity with --long)")
    p.add_argument("--partitions", type=int, default=3, help="request partitions")
    p.add_argument("--ids", action="store_true",
                   help="every pre-produced request carries its own schedule id (on the id's "
                        "partition, as the client library writes it)")
    p.add_argument("--value-size", type=int, default=100, help="request value bytes")
    p.add_argument("--batch-size", type=int, default=1_000,
                   help="kdelay batch_size and the pipe's consume batch")
    for name, (full, quick) in SIZES.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float,
                       help=f"default {full:,.0f} ({quick:,.0f} with --quick)")
    p.add_argument("--pipe-repeats", type=int, default=3,
                   help="pipe runs over the same requests; the median is the baseline")
    p.add_argument("--lateness-rate", type=int, default=5_000, help="deliveries per second")
    p.add_argument("--lateness-warmup-seconds", type=float, default=3.0)
    p.add_argument("--lateness-delay-ms", type=int, default=500,
                   help="due = produce time + this")
    p.add_argument("--lateness-drain-seconds", type=float, default=30.0,
                   help="how long after the last due time records may still arrive")
    p.add_argument("--guarantees", type=_names, default=GUARANTEES,
                   help="guarantees the lateness scenario runs with")
    p.add_argument("--fresh-broker", action="store_true",
                   help="before each guarantee's lateness runs, restart the broker tools/kafka "
                   "runs (not with --bootstrap-servers or KDELAY_BOOTSTRAP_SERVERS; every other "
                   "client of that broker loses it meanwhile); the hop baseline then runs last")
    p.add_argument("--fresh-broker-wait", type=float, default=60.0,
                   help="seconds from the broker restart to the first lateness run")
    p.add_argument("--footprint-values", type=_ints, default=(100, 1_000),
                   help="value sizes of the footprint scenario")
    p.add_argument("--json", type=Path, help="write JSON lines here instead of stdout")
    p.add_argument("--markdown", type=Path, help="write the tables here instead of stderr")
    p.add_argument("--charts", type=Path, help="draw the run's SVG charts into this directory "
                   "(with --json; e.g. docs/assets/benchmarks)")
    p.add_argument("--peer", type=Path, help="a second scheduler's binary (etf1's "
                   "kafka-message-scheduler, built by tools/peer build): burst, intake and "
                   "lateness run against it too, and the report puts the two side by side")
    p.add_argument("--burst-lead-s", type=float, help="seconds from the start of the "
                   "burst's write to its due instant (default: 15 + records/50k + "
                   "records/20k); both schedulers must take the records in meanwhile")
    p.add_argument("--catchup-rate", type=int, default=2_000, help="the catchup scenario's "
                   "catch-up rate, records a second (default 2000)")
    p.add_argument("--work-dir", type=Path, help="state directories (default: a temp dir)")
    p.add_argument("--keep-topics", action="store_true", help="do not delete bench topics")
    return p


def _scenarios(args: argparse.Namespace) -> tuple[str, ...]:
    chosen: tuple[str, ...] = args.scenarios or tuple(
        s for s in SCENARIOS if s not in OPT_IN or (s == "capacity" and args.long))
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"tools/bench: unknown scenarios {unknown}; choose from {SCENARIOS}")
    return chosen


def _size(args: argparse.Namespace, name: str) -> float:
    given: float | None = getattr(args, name)
    if given is not None:
        return given
    full, quick = SIZES[name]
    return quick if args.quick else full


def _peer(path: Path | None) -> Path | None:
    """Return the peer binary's absolute path; exit with a message if it cannot run."""
    if path is None:
        return None
    if not path.is_file() or not os.access(path, os.X_OK):
        raise SystemExit(f"tools/bench: --peer {path} is not an executable file "
                         "(tools/peer build prints the path of one)")
    return path.resolve()


def parse_options(argv: list[str] | None = None) -> BenchOptions:
    """Parse ``argv`` (default ``sys.argv``); unset sizes take the mode's defaults."""
    args = _parser().parse_args(argv)
    bad = sorted(set(args.guarantees) - set(GUARANTEES))
    if bad:
        raise SystemExit(f"tools/bench: unknown guarantees {bad}; choose from {GUARANTEES}")
    return BenchOptions(
        bootstrap_servers=args.bootstrap_servers, scenarios=_scenarios(args),
        quick=args.quick, partitions=args.partitions, value_size=args.value_size, ids=args.ids,
        batch_size=args.batch_size, pipe_repeats=max(1, args.pipe_repeats),
        intake_records=int(_size(args, "intake_records")),
        burst_records=int(_size(args, "burst_records")),
        lateness_rate=args.lateness_rate, lateness_seconds=_size(args, "lateness_seconds"),
        lateness_warmup_seconds=args.lateness_warmup_seconds,
        lateness_delay_ms=args.lateness_delay_ms,
        lateness_drain_seconds=args.lateness_drain_seconds,
        lateness_runs=max(1, int(_size(args, "lateness_runs"))),
        fresh_broker=args.fresh_broker, fresh_broker_wait=args.fresh_broker_wait,
        guarantees=tuple(args.guarantees),
        footprint_entries=int(_size(args, "footprint_entries")),
        footprint_values=tuple(args.footprint_values),
        restore_entries=int(_size(args, "restore_entries")),
        capacity_pending=int(_size(args, "capacity_pending")),
        capacity_base=int(_size(args, "capacity_base")),
        operator_pending=(int(_size(args, "operator_pending")),
                          *((OPERATOR_LONG_PENDING,) if args.long else ())),
        spark_requests=int(_size(args, "spark_requests")),
        transfer_pending=int(_size(args, "transfer_pending")),
        console_pending=int(_size(args, "console_pending")),
        json_path=args.json, markdown_path=args.markdown, work_dir=args.work_dir,
        keep_topics=args.keep_topics, charts_dir=args.charts, peer=_peer(args.peer),
        burst_lead_s=args.burst_lead_s, campaign_rows=int(_size(args, "campaign_rows")),
        catchup_records=int(_size(args, "catchup_records")), catchup_rate=args.catchup_rate,
    )
