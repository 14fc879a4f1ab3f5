"""The generated reference pages (docs/reference/) say what the code says now.

They are written by ``tools/docs`` from the typer app, the settings, the metrics
registry, the alert rules and the error codes; a page edited by hand, or code
changed without running ``tools/docs``, fails here.
"""

from __future__ import annotations

import docs_reference  # tools/, on pytest's pythonpath


def test_every_reference_page_is_what_the_code_generates_now() -> None:
    assert docs_reference.stale() == [], "run tools/docs and commit docs/reference/"


def test_the_cli_reference_names_every_command_and_its_environment_variables() -> None:
    page = docs_reference.cli_page()
    for command in ("kdelay run", "kdelay send", "kdelay topics create", "kdelay web",
                    "kdelay retention check"):
        assert f"## `{command}`" in page
    assert "`KDELAY_BOOTSTRAP_SERVERS`" in page


def test_every_dlq_code_has_a_meaning() -> None:
    from kdelay.protocol.envelope import MEANINGS, ErrorCode

    assert set(MEANINGS) == set(ErrorCode)
    page = docs_reference.errors_page()
    assert all(f"`{code.value}`" in page for code in ErrorCode)
    assert "`broker-unreachable`" in page, "codes named by constants are found too"


def test_the_metrics_reference_lists_the_registry_and_the_alerts() -> None:
    page = docs_reference.metrics_page()
    assert "`kdelay_delivered_records_total` | counter" in page
    assert "`kdelay_dead_lettered_records_total` | counter | `reason`" in page
    assert "`KdelayKafkaUnreachable`" in page
