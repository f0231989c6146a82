"""Fixtures for the allocator tests (helpers live in ``helpers.py``)."""

from __future__ import annotations

import os

import pytest

from .helpers import SNAPSHOT_DIR


@pytest.fixture
def snapshot_path():
    def path(name: str) -> str:
        return os.path.join(SNAPSHOT_DIR, name)

    return path
