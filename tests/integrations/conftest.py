"""Fixtures: see tests/support/fixtures.py."""

from tests.support.fixtures import certs, https, local, served  # noqa: F401
