"""Shared fixtures. Most tests run ranks simulated in this process (tier 1 of DESIGN.md)."""

from __future__ import annotations

import os

# Layout tests compare with JAX on 64 virtual CPU devices; the flag must be set before jax starts.
os.environ["XLA_FLAGS"] = " ".join(
    f for f in [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=64"] if f
)

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import vsf  # noqa: E402

# Property tests: a fixed budget of examples, no per-example deadline (the first simulated
# example of a process pays one-off start-up costs); tests that need another budget say so.
# Local runs explore new examples each time; CI (CI=true) runs a fixed, reproducible set.
settings.register_profile(
    "vsf",
    max_examples=40,
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "vsf"))


@pytest.fixture
def sim():
    """``sim(n)`` starts an n-rank simulation with real numbers for the test; it stops afterwards."""
    started: list[vsf.simulate] = []

    def start(n: int, *, compute: bool = True) -> vsf.simulate:
        s = vsf.simulate(n, compute=compute).start()
        started.append(s)
        return s

    yield start
    for s in reversed(started):
        s.stop()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
