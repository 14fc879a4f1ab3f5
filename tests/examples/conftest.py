"""The end-to-end fixtures (a deployment, a running ``kdelay run``, receivers) for the
language examples."""

from tests.e2e.conftest import (  # noqa: F401  (fixtures and the report hook, shared)
    deploy,
    pytest_runtest_makereport,
    receiver,
    start_kdelay,
)
