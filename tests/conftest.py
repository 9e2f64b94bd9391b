"""Shared test settings. The gloo worker pools come from fsdpfn's pytest plugin
(fsdpfn.testing.pytest_plugin, registered as a pytest11 entry point)."""

import os

from hypothesis import HealthCheck, settings

# Each example may cross process boundaries (a gloo round trip): no per-example deadline.
settings.register_profile(
    "fsdpfn",
    deadline=None,
    max_examples=int(os.environ.get("FSDPFN_HYPOTHESIS_EXAMPLES", "30")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("fsdpfn")

# pytest turns warnings into errors here (pyproject); the gloo worker ranks do the same.
os.environ.setdefault("FSDPFN_WORKER_WARNINGS", "error")
