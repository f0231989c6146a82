"""The real node's tests: a kubelet, containerd, runc, CNI bridge networking and a local
image registry on this machine (``localkube/kubelet.py``), under a control plane of their
own; and the project on it (``tests/realnode/node_cluster.py``): estimation pods from the
project's image and training images.

They build things (the node's binaries: about 15 minutes cold; a Debian base image: about a
minute; the project's image about a minute, each training image 5 minutes and 5-6 GB) and need
root, so they are not part of `make test`: `make node-test` builds what they need
and runs them with XMEM_REAL_NODE_TESTS=1. Without it each module skips itself, naming that
command. The fixtures below go through the project's own scripts, each of which returns at once
when its result exists (the cache entries, the image in podman's store).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from localkube.controlplane import ControlPlane
    from localkube.kubelet import RealNode

ROOT = Path(__file__).resolve().parents[2]
ENABLED = os.environ.get("XMEM_REAL_NODE_TESTS") == "1"
SKIP_REASON = ("the real node's tests build and run a kubelet, containerd and images as root "
               "(minutes): run them with `make node-test` (XMEM_REAL_NODE_TESTS=1)")


def _script(*argv: str, timeout: float = 3600) -> str:
    """Run one of the project's scripts; its last line of output."""
    result = subprocess.run(["bash", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stderr[-4000:]}"
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.fixture(scope="session")
def node_built() -> None:
    """Debian's runc, CNI plugins, iptables and podman; the control plane; the node's binaries."""
    if not ENABLED:
        pytest.skip(SKIP_REASON)
    from localkube import kubelet

    _script("scripts/install-image-tools.sh", timeout=900)
    _script("scripts/build-kube.sh")
    _script("scripts/build-node.sh")
    reason = kubelet.missing()
    if reason:
        pytest.fail(reason)


@pytest.fixture(scope="session")
def base_image(node_built: None) -> str:
    """A Debian bookworm image with Python (scripts/base-image.sh), in podman's store."""
    return _script("scripts/base-image.sh", "bookworm", timeout=900)


@pytest.fixture(scope="session")
def sandbox_image(base_image: str) -> str:
    from localkube import kubelet

    return kubelet.pause_image(base_image)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, node_built: None) -> Iterator[ControlPlane]:
    from localkube.controlplane import ControlPlane

    running = ControlPlane(tmp_path_factory.mktemp("plane"))
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture
def real_node(plane: ControlPlane, sandbox_image: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    """A started RealNode; stopped (and everything it made removed) after the test, also when
    the test stopped it itself."""
    from localkube.kubelet import RealNode

    node = RealNode(plane, tmp_path_factory.mktemp("node"))
    try:
        node.start(sandbox_image)
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def project_image(node_built: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The project's image (`make image`), from a copy of the sources taken at one instant."""
    from localkube import images

    try:
        return images.project_image(tmp_path_factory.mktemp("context"))
    except images.ImageBuildFailed as err:
        pytest.fail(str(err))


@pytest.fixture(scope="session")
def training_image(node_built: None) -> Callable[[str, str], str]:
    """A training image for (torch release, Python minor), built here when it is missing."""
    from localkube import images

    def get(torch: str, python: str) -> str:
        try:
            return images.training_image(torch, python)
        except images.ImageBuildFailed as err:
            pytest.fail(str(err))

    return get


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ENABLED:
        from localkube import images

        for line in images.summary().splitlines():
            terminalreporter.write_line(line)
