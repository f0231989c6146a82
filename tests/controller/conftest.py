"""Fixtures of the controller tests (see support.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.controller.support import Harness


@pytest.fixture()
def harness(tmp_path: Path) -> Iterator[Harness]:
    running = Harness(tmp_path)
    try:
        yield running
    finally:
        running.close()
