"""pytest fixtures shared by the admission, integrations, backends and policy tests."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.harness import Certificates, HttpsWebhook, LocalWebhook, make_policy


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def https(certs: Certificates) -> Iterator[HttpsWebhook]:
    """One real TLS server per test module; tests set its policy and records."""
    served = HttpsWebhook(make_policy(), certs)
    try:
        yield served
    finally:
        served.close()


@pytest.fixture()
def served(https: HttpsWebhook) -> Iterator[HttpsWebhook]:
    """The module's server with a fresh store and the default policy for each test."""
    https.store.clear()
    https.use(make_policy())
    yield https


@pytest.fixture()
def local() -> LocalWebhook:
    return LocalWebhook(make_policy())
