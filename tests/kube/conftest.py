"""Fixtures for the API-server contract tests: a real control plane of their own (see real.py),
reset between tests, with official clients."""

from __future__ import annotations

from typing import Any, Iterator

import pytest


@pytest.fixture(scope="session")
def real_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from localkube.controlplane import ControlPlane
    from tests.kube.real import CONTROLLERS, RealServer

    plane = ControlPlane(tmp_path_factory.mktemp("contract-kube"), controllers=CONTROLLERS,
                         scheduler=False)
    try:
        plane.start()
        real = RealServer(plane)
        yield real
        real.close()
    finally:
        plane.stop()


@pytest.fixture()
def server(real_plane: Any) -> Iterator[Any]:
    real_plane.reset()
    yield real_plane


@pytest.fixture()
def client(server: Any) -> Iterator[Any]:
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
