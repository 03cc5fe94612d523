"""Shared fixtures. Most tests run ranks simulated in this process (tier 1 of DESIGN.md)."""

from __future__ import annotations

import pytest
import torch

import vsf


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
