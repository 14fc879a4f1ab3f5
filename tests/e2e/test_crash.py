"""The crash harness in CI: SIGKILL `kdelay run` under load, for both guarantees."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.e2e.conftest import OwnBroker

ROOT = Path(__file__).resolve().parents[2]


def _harness() -> ModuleType:
    path = ROOT / "tools" / "crash_harness.py"
    spec = importlib.util.spec_from_file_location("crash_harness", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["crash_harness"] = module
    spec.loader.exec_module(module)
    return module


# On the oldest and newest brokers (the compatibility subset) only the exactly-once
# case runs: transactions, fencing and a broker kill are what differ between versions.
@pytest.mark.parametrize(("guarantee", "broker_kills"),
                         [("at-least-once", 0),
                          pytest.param("exactly-once", 1, marks=pytest.mark.compat)])
def test_ten_kills_lose_nothing_and_stay_within_the_guarantee(
    request: pytest.FixtureRequest, tmp_path: Path, guarantee: str, broker_kills: int,
) -> None:
    harness = _harness()
    # A broker kill takes a broker of the test's own: the shared one serves the
    # tests running beside this one (tools/test runs two parts side by side).
    if broker_kills:
        broker: OwnBroker = request.getfixturevalue("own_broker")
        bootstrap, broker_env = broker.bootstrap, broker.env
    else:
        bootstrap, broker_env = request.getfixturevalue("bootstrap"), None
    # 30 % of the requests carry an id and are written by their key, off the id's
    # partition (tools/crash's default): forwards and id outcomes go through the kills.
    options = harness.Options(bootstrap, guarantee, kills=10, rate=150, state_loss=0.3,
                              broker_kills=broker_kills, min_up_s=0.5, max_up_s=2.5,
                              seed=7, workdir=tmp_path, ids=0.3,
                              broker_env=broker_env)
    report = harness.run(options)
    print(report.table())
    assert report.requests > 500
    assert report.lost == 0
    assert report.early == 0
    assert report.dead_lettered == 0
    assert report.delivered == report.requests
    if guarantee == "exactly-once":
        assert report.duplicates == 0
    else:
        assert report.unexplained_duplicates == 0
