"""Fixtures shared across test areas.

``cluster``: one real control plane for the whole session (etcd, kube-apiserver,
controller-manager, scheduler, kwok GPU nodes, the project's process node, the chart's CRDs and
RBAC), started the first time a test asks for it. It comes from ``make tools``
(``scripts/build-kube.sh``); when it is missing the tests fail and say so: CI runs ``make tools``
first, so a missing binary there is a failure.

``trainer``: Kubeflow Trainer's controller manager and the JobSet controller it needs
(``localkube.trainer``; ``trainer.jobset`` is the JobSet one), with their CRDs, webhooks and the
``torch-distributed`` ClusterTrainingRuntime, on that control plane for the rest of the session.
Built by ``make tools`` (``scripts/build-trainer.sh``); missing, the tests fail in the same way.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:  # the control plane's client is not in the users' torch environments, where
    # `make test` runs the probe's own tests with other torch releases (tests/support/torch_envs.py)
    from localkube.cluster import Cluster
    from localkube.trainer import Trainer


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[Cluster]:
    from localkube.cluster import Cluster

    running = Cluster(tmp_path_factory.mktemp("kube"))
    try:
        running.start()
    except BaseException:
        running.stop()
        raise
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    line = f"real control plane: {running.plane.version()} (kube-apiserver --version)"
    if reporter is not None:
        # Fixture output is captured (and shown only on failure): the version goes to the test
        # log with capture suspended.
        with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
            reporter.write_line("")
            reporter.write_line(line)
    print(line)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def trainer(cluster: Cluster) -> Iterator[Trainer]:
    from localkube.trainer import Trainer

    running = Trainer(cluster).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def deviceless_cudnn():
    """The libcudnn this environment's torch brings, when it plans without a GPU (cuDNN 9.11 and
    newer, ``estimator.cudnn_heuristics``); the test is skipped, saying why, otherwise."""
    from xmem_admission.estimator import cudnn_heuristics as ch

    try:
        lib = ch.load_cudnn()
    except ch.CudnnPlanningUnavailable as err:
        pytest.skip(str(err))
    if not lib.deviceless:
        pytest.skip(f"cuDNN {lib.version_text} predates deviceless plans")
    return lib
