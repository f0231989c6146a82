"""Fixtures of the controller tests (see support.py)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Iterator

import pytest

from localkube.cluster import Cluster
from tests.controller.support import Harness

_counter = itertools.count()


@pytest.fixture()
def harness(cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Harness]:
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[5:40].strip("-")
    running = Harness(cluster, f"c{next(_counter)}-{stem}", tmp_path)
    try:
        yield running
    finally:
        running.close()
