"""The Grafana dashboard and the alert rules name only metrics the service exports.

Exported names come from a fresh :class:`~kdelay.engine.metrics.Metrics` registry:
each family's own name, with the suffixes Prometheus's text format gives it
(``_total`` for a counter, ``_bucket``, ``_count`` and ``_sum`` for a
histogram). Labelled families without a series yet are included: a registry
knows them before they have samples.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kdelay.engine.metrics import Metrics
from tests.conftest import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "kdelay.json"
RULES = ROOT / "deploy" / "prometheus" / "kdelay-rules.yml"
METRIC_NAME = re.compile(r"\bkdelay_[a-z0-9_]+\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
            "gauge": ("",)}


def exported() -> dict[str, str]:
    """Every series name the service can export, mapped to its family's name."""
    names: dict[str, str] = {}
    for family in Metrics().registry.collect():
        for suffix in SUFFIXES[family.type]:
            names[family.name + suffix] = family.name
    return names


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template queries."""
    board: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", ())]
    exprs += [variable["definition"] for variable in board["templating"]["list"]]
    return exprs


def rule_exprs() -> list[str]:
    """Every ``expr:`` of the rules file (each is written on one line)."""
    return [line.split("expr:", 1)[1].strip() for line in
            RULES.read_text(encoding="utf-8").splitlines() if line.strip().startswith("expr:")]


def test_dashboard_names_only_exported_metrics() -> None:
    names = exported()
    used = {name for expr in dashboard_exprs() for name in METRIC_NAME.findall(expr)}
    assert used
    assert used <= set(names), sorted(used - set(names))


def test_every_exported_metric_has_a_panel() -> None:
    names = exported()
    shown = {names[name] for expr in dashboard_exprs() for name in METRIC_NAME.findall(expr)}
    assert shown == set(names.values()), sorted(set(names.values()) - shown)


def test_rules_name_only_exported_metrics() -> None:
    names = exported()
    exprs = rule_exprs()
    assert len(exprs) == 19
    used = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert used <= set(names), sorted(used - set(names))


def test_dashboard_is_importable() -> None:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert board["uid"] == "kdelay"
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert refs, panel["title"]
        assert len(refs) == len(set(refs)), panel["title"]
