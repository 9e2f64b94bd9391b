"""pytest plugin: session-wide gloo worker pools for fsdpfn and its users' test suites.

Installed with fsdpfn (entry point ``pytest11``), so the fixtures below are available in any
suite. Pools start on first use, once per world size, and stop when the session ends.

Example (a user's test)::

    def _check(rank, world_size):
        ...  # build the mesh, plan, shard; compare with a one-process reference
        return result

    def test_my_plan(run_on_ranks):
        results = run_on_ranks(_check, world_size=4)
        assert all(r == results[0] for r in results)
"""

from __future__ import annotations

import pytest

from fsdpfn.testing._harness import run_on_ranks as _run_on_ranks
from fsdpfn.testing._harness import shutdown_pools


def pytest_addoption(parser):
    parser.addoption(
        "--fsdpfn-timeout",
        type=float,
        default=None,
        help="seconds before a multi-rank fsdpfn test is declared hung (default 180)",
    )


@pytest.fixture(scope="session")
def run_on_ranks(request):
    """``run_on_ranks(fn, world_size, *args, **kwargs)`` with the session's timeout applied."""
    timeout = request.config.getoption("--fsdpfn-timeout")

    def run(fn, world_size=2, *args, **kwargs):
        kwargs.setdefault("timeout", timeout)
        return _run_on_ranks(fn, world_size, *args, **kwargs)

    return run


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
