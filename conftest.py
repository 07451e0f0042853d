"""Test-suite settings shared by every tox env.

Test directories are packages, imported by their path from the repository root
(``--import-mode=importlib`` with the root on ``pythonpath``), so a test imports its
worker module as ``tests.engine.engine_workers`` rather than by a bare name, and a spawned
process can import the same function. Tests marked ``slow`` (soaks, long live runs) are
skipped unless ``--run-slow`` is given: CI runs the rest. Live worlds (``shardcore.testing.run_world``)
keep their processes for the whole session: starting a rank and importing torch costs seconds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shardcore.testing import kept_worlds


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (soaks, long live runs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _kept_worlds() -> Iterator[None]:
    with kept_worlds():
        yield
