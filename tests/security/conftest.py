"""Fixtures of the security tests: two tenants per module on the session's real control plane
(see tenants.py)."""

from __future__ import annotations

from typing import Iterator

import pytest

from localkube.cluster import Cluster
from tests.security.tenants import TwoTenants


@pytest.fixture(scope="module")
def tenants(cluster: Cluster) -> Iterator[TwoTenants]:
    running = TwoTenants(cluster)
    try:
        yield running
    finally:
        running.close()
