"""Fixtures of the security tests: one two-tenant cluster per module (see tenants.py)."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.security.tenants import TwoTenants


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoTenants]:
    running = TwoTenants(tmp_path_factory.mktemp("tenants"))
    try:
        yield running
    finally:
        running.close()
