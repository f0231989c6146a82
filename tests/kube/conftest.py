"""Fixtures for the stand-in cluster's own tests: a fresh API server and official clients."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.fakekube.apiserver import ApiServer


@pytest.fixture()
def server() -> Iterator[ApiServer]:
    with ApiServer() as running:
        yield running


@pytest.fixture()
def client(server: ApiServer) -> Iterator[Any]:
    api_client = server.api_client()
    try:
        yield api_client
    finally:
        api_client.close()


@pytest.fixture()
def core(client: Any) -> Any:
    from kubernetes import client as k8s

    return k8s.CoreV1Api(client)


@pytest.fixture()
def batch(client: Any) -> Any:
    from kubernetes import client as k8s

    return k8s.BatchV1Api(client)


@pytest.fixture()
def custom(client: Any) -> Any:
    from kubernetes import client as k8s

    return k8s.CustomObjectsApi(client)
