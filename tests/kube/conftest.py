"""Fixtures for the API-server contract tests: each test runs against the stand-in
(``tests.fakekube``) and against the real control plane (``tests.realkube``), with official
clients. Tests marked ``imitation_only`` use what only the stand-in offers (injected faults,
compaction on demand, its node) and run against it alone. Tests marked
``imitation_differs(reason)`` assert what kube-apiserver does where the stand-in does otherwise:
on the stand-in they are expected to fail (strictly: once it is fixed, the mark must go)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.fakekube.apiserver import ApiServer


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "imitation_only: uses what only the stand-in offers")
    config.addinivalue_line("markers", "imitation_differs(reason): the stand-in is known to "
                            "answer otherwise than kube-apiserver")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "server" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("imitation_only"):
        metafunc.parametrize("side", ["imitation"])
        return
    differs = metafunc.definition.get_closest_marker("imitation_differs")
    imitation: object = "imitation"
    if differs is not None:
        imitation = pytest.param("imitation", marks=pytest.mark.xfail(
            strict=True, reason=f"the stand-in differs from kube-apiserver: {differs.args[0]}"))
    metafunc.parametrize("side", [imitation, "real"])


@pytest.fixture(scope="session")
def real_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.kube.real import CONTROLLERS, RealServer
    from tests.realkube.controlplane import ControlPlane

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
def server(side: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    if side == "real":
        real = request.getfixturevalue("real_plane")
        real.reset()
        yield real
        return
    with ApiServer() as running:
        yield running


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
