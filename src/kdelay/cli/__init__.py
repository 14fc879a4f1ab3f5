"""The ``kdelay`` command line (typer): one module per group of commands.

Commands hold no logic: each builds the settings once, from the common
options (:mod:`kdelay.cli.options`, the one place options, environment
variables and error reporting are defined), and calls a library function.

- :mod:`~kdelay.cli.service`: ``run``, ``topics create``, ``topics grow``, ``restore``
- :mod:`~kdelay.cli.requests`: ``send`` (one record or a series), ``cancel``, ``reschedule``
- :mod:`~kdelay.cli.view`: ``due``, ``backlog``, ``show``, ``tail``, ``stats``
- :mod:`~kdelay.cli.retention`: ``retention check``, ``retention set``
- :mod:`~kdelay.cli.worker`: ``worker``
- :mod:`~kdelay.cli.spark`: ``audit``, ``forecast``, ``schedule-table`` (the spark extra)
- :mod:`~kdelay.cli.transfer`: ``export``, ``import`` (JSON lines, or Parquet through Spark)
- :mod:`~kdelay.cli.targets`: ``target pause``, ``resume``, ``limit``, ``list``
- :mod:`~kdelay.cli.web`: ``web`` (the web extra)

The CLI is the top of the package: it may import every other room, and none
imports it.
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated

import typer

from kdelay import native
from kdelay.cli import (
    requests,
    retention,
    service,
    spark,
    targets,
    transfer,
    view,
    web,
    worker,
)
from kdelay.cli.options import envvar

__all__ = ["app", "envvar", "main"]

app = typer.Typer(
    name="kdelay",
    help="Delayed and scheduled delivery for Apache Kafka.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # locals can hold SASL passwords
)
topics_app = typer.Typer(help="Manage kdelay's topics.", no_args_is_help=True)
retention_app = typer.Typer(help="Check the requests topic's retention.", no_args_is_help=True)
target_app = typer.Typer(help="Pause, resume and cap deliveries to a target or lane.",
                         no_args_is_help=True)



def show_version(shown: bool) -> None:
    """``--version``: kdelay's version and how its delivery hot path runs, then exit."""
    if shown:
        typer.echo(f"kdelay {metadata.version('kdelay')} (delivery hot path {native.mode})")
        raise typer.Exit


@app.callback()
def top(version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=show_version,
        help="Print the version and whether the delivery hot path runs compiled, "
             "then exit.")] = False) -> None:
    """Delayed and scheduled delivery for Apache Kafka."""


# Registration order is the order `kdelay --help` lists the commands in.
app.add_typer(topics_app, name="topics")
app.command("run")(service.run)
topics_app.command("create")(service.topics_create)
topics_app.command("grow")(service.topics_grow)
app.command("send")(requests.send)
app.command("cancel")(requests.cancel)
app.command("reschedule")(requests.reschedule)
app.command("restore")(service.restore)
app.command("audit")(spark.audit)
app.command("forecast")(spark.forecast)
app.command("schedule-table")(spark.schedule_table)
app.command("tail")(view.tail)
app.add_typer(retention_app, name="retention")
app.command("due")(view.due_command)
app.command("backlog")(view.backlog_command)
app.command("show")(view.show_command)
retention_app.command("check")(retention.retention_check)
retention_app.command("set")(retention.retention_set)
app.command("worker")(worker.worker)
app.command("stats")(view.stats)
app.add_typer(target_app, name="target")
target_app.command("pause")(targets.pause)
target_app.command("resume")(targets.resume)
target_app.command("limit")(targets.limit)
target_app.command("list")(targets.list_command)
app.command("export")(transfer.export_command)
app.command("import")(transfer.import_command)
app.command("web")(web.web)


def main() -> None:
    """Entry point of the ``kdelay`` console script."""
    app()


if __name__ == "__main__":
    main()
