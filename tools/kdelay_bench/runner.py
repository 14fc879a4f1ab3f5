"""Run the chosen scenarios in order, then write JSON lines and markdown tables.

Every scenario runs in this process tree against one broker, so the ratios to
the pipe compare figures taken minutes apart on the same machine. A scenario
that fails is reported as skipped with its error and the run goes on.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

from kdelay_bench import chart, served
from kdelay_bench.broker import Topics, bootstrap_servers, external_broker, left_running
from kdelay_bench.campaign import run_campaign
from kdelay_bench.capacity import run_capacity
from kdelay_bench.catchup import run_catchup
from kdelay_bench.console import run_console
from kdelay_bench.floor import relate as relate_to_floor
from kdelay_bench.floor import run_floor
from kdelay_bench.footprint import run_footprint
from kdelay_bench.lateness import Load, Suite
from kdelay_bench.machine import finish, machine
from kdelay_bench.operator_view import run_operator
from kdelay_bench.options import BenchOptions, parse_options
from kdelay_bench.progress import say
from kdelay_bench.report import Result, markdown, relate_to_pipe, write_json
from kdelay_bench.restore import run_restore
from kdelay_bench.spark_jobs import run_spark
from kdelay_bench.steady import Plan, hop_p99, run_hop, run_suite
from kdelay_bench.throughput import Setup, pipe_and_intake
from kdelay_bench.transfer import run_transfer


def _guarded(name: str, scenario: Callable[[], list[Result]]) -> list[Result]:
    """Run one scenario; turn an exception into a skipped result."""
    try:
        return scenario()
    except Exception as exc:  # one failed scenario must not end the run
        traceback.print_exc(file=sys.stderr)
        return [Result(name, skipped=f"{type(exc).__name__}: {exc}")]


def _pipe(results: list[Result]) -> Result | None:
    return next((r for r in results if r.scenario == "pipe" and not r.skipped), None)


def _suite(setup: Setup, guarantee: str, load: Load, plan: Plan) -> Suite:
    """Run one guarantee's suite; turn an exception into a skipped suite."""
    try:
        return run_suite(setup, guarantee, load, plan)
    except Exception as exc:  # one failed suite must not end the run
        traceback.print_exc(file=sys.stderr)
        return Suite(guarantee, plan.runs, {}, skipped=f"{type(exc).__name__}: {exc}")


def _load(options: BenchOptions) -> Load:
    """The steady load of the lateness scenario."""
    return Load(options.lateness_rate, options.lateness_seconds,
                options.lateness_warmup_seconds, options.lateness_delay_ms,
                options.lateness_drain_seconds)


def _lateness(options: BenchOptions, setup: Setup) -> list[Result]:
    """The hop baseline and every guarantee's suite. With a fresh broker per suite the
    hop runs last, so that no suite waits for it after its broker restart."""
    load = _load(options)
    plan = Plan(options.lateness_runs,
                options.fresh_broker_wait if options.fresh_broker else None)
    hop = [] if options.fresh_broker else _guarded("hop", lambda: run_hop(setup, load))
    suites = [_suite(setup, guarantee, load, plan) for guarantee in options.guarantees]
    if options.fresh_broker:
        hop = _guarded("hop", lambda: run_hop(setup, load))
    return [*hop, *(r for suite in suites for r in suite.results(hop_p99(hop)))]


def _scenarios(options: BenchOptions, setup: Setup, results: list[Result]) -> None:
    """Run every chosen scenario, appending to ``results`` as they finish."""
    chosen = set(options.scenarios)
    if "floor" in chosen:
        results += _guarded("floor", lambda: [run_floor(setup, options.burst_records)])
    if chosen & {"pipe", "intake", "burst"}:
        results += _guarded("pipe", lambda: pipe_and_intake(
            setup, options.intake_records, options.pipe_repeats, "intake" in chosen,
            run_floor="burst" in chosen))
    if "burst" in chosen:
        results += _guarded("burst", lambda: served.burst(
            setup, options.burst_records, _pipe(results), options.burst_lead_s))
    peer = options.peer
    if peer is not None:
        _peer_scenarios(options, setup, peer, results)
    if "lateness" in chosen:
        results += _lateness(options, setup)
        if peer is not None:
            results += _guarded("peer-lateness", lambda: served.peer_steady(
                setup, peer, _load(options)))
    if "catchup" in chosen:
        results += _guarded("catchup", lambda: [run_catchup(
            setup, options.catchup_records, options.catchup_rate)])
    if "footprint" in chosen:
        results += _guarded("footprint", lambda: run_footprint(
            setup.work_dir, options.footprint_entries, options.footprint_values))
    if "restore" in chosen:
        results += _guarded("restore", lambda: [run_restore(
            setup.topics, setup.work_dir, options.restore_entries)])
    if "capacity" in chosen:
        results += _guarded("capacity", lambda: [run_capacity(
            setup, options.capacity_base, options.capacity_pending)])
    if "operator" in chosen:
        results += _guarded("operator", lambda: _operator(options, setup))
    if "spark" in chosen:
        results += _guarded("spark-audit", lambda: run_spark(
            setup.topics, setup.work_dir, options.spark_requests, options.partitions))
    if "campaign" in chosen:
        results += _guarded("campaign", lambda: run_campaign(
            setup.topics, setup.work_dir, options.campaign_rows, options.partitions))
    if "transfer" in chosen:
        results += _guarded("transfer", lambda: [run_transfer(
            setup.topics, setup.work_dir, options.transfer_pending, options.partitions,
            options.batch_size)])
    if "console" in chosen:
        results += _guarded("console", lambda: [run_console(
            setup.topics, setup.work_dir, options.console_pending, options.partitions,
            options.value_size, options.batch_size)])


def _peer_scenarios(options: BenchOptions, setup: Setup, peer: Path,
                    results: list[Result]) -> None:
    """The burst and intake scenarios against the peer (and ``kdelay run``'s intake
    beside it), as chosen."""
    if "burst" in options.scenarios:
        results += _guarded("peer-burst", lambda: served.peer_burst(
            setup, peer, options.burst_records, options.burst_lead_s))
    if "intake" in options.scenarios:
        results += _guarded("peer-intake", lambda: served.intake_pair(
            setup, peer, options.intake_records))


def _operator(options: BenchOptions, setup: Setup) -> list[Result]:
    return [run_operator(setup.topics, setup.work_dir, count, options.partitions,
                         options.value_size, options.batch_size)
            for count in options.operator_pending]


def _write(options: BenchOptions, results: list[Result]) -> None:
    if options.json_path is None:
        write_json(results, sys.stdout)
    else:
        with options.json_path.open("w") as out:
            write_json(results, out)
        if options.charts_dir is not None:
            for path in chart.draw(options.json_path, options.charts_dir):
                sys.stderr.write(f"chart: {path}\n")
    tables = markdown(results)
    if options.markdown_path is None:
        sys.stderr.write("\n" + tables)
    else:
        options.markdown_path.write_text(tables)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; return 0 unless the run itself could not happen."""
    options = parse_options(argv)
    if "pipe" not in options.scenarios and {"intake", "burst"} & set(options.scenarios):
        say("note: intake and burst ratios need the pipe, which runs with them")
    if options.fresh_broker and external_broker(options.bootstrap_servers):
        raise SystemExit("tools/bench: --fresh-broker restarts the broker tools/kafka runs; "
                         "drop --bootstrap-servers and unset KDELAY_BOOTSTRAP_SERVERS")
    bootstrap = bootstrap_servers(options.bootstrap_servers)
    work_dir = options.work_dir or Path(tempfile.mkdtemp(prefix="kdelay-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    topics = Topics(bootstrap, uuid.uuid4().hex[:8])
    setup = Setup(topics, work_dir, options.partitions, options.value_size, options.batch_size,
                  options.ids)
    say(f"broker {bootstrap}; state under {work_dir}; scenarios {','.join(options.scenarios)}")
    record = machine(bootstrap)
    results: list[Result] = [record]
    try:
        _scenarios(options, setup, results)
    finally:
        if not options.keep_topics:
            topics.cleanup()
        if options.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    finish(record)
    relate_to_pipe(results)
    relate_to_floor(results)
    _write(options, results)
    hint = left_running(options.bootstrap_servers, bootstrap)
    if hint is not None:
        say(hint)
    return 0
