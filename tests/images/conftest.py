"""The image tests: the project's image built from the Dockerfile and training images
standing for users', run under podman the way the chart and an estimation pod run them.

They build images (minutes, several GB), so they are not part of `make test`: `make image-test`
builds the images and runs them with XMEM_IMAGE_TESTS=1. Without it this folder is not collected.
Each fixture reuses an image that exists already (the build scripts do); the containers and
volumes a test makes are removed by it. `podman rmi` the images listed by `podman images
localhost/xmem-*` to free their disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, Tuple

import pytest

from localkube import images

ENABLED = os.environ.get("XMEM_IMAGE_TESTS") == "1"
collect_ignore_glob = [] if ENABLED else ["test_*.py"]


@dataclass(frozen=True)
class ProjectImage:
    reference: str
    context: Path  # the build context: what the Dockerfile copied, as it was at the build


@pytest.fixture(scope="session")
def project_build(tmp_path_factory: pytest.TempPathFactory) -> ProjectImage:
    """The project's image (`make image`), from a copy of the sources taken at one instant."""
    context = tmp_path_factory.mktemp("context")
    return ProjectImage(_built(lambda: images.project_image(context)), context)


@pytest.fixture(scope="session")
def project_image(project_build: ProjectImage) -> str:
    return project_build.reference


@pytest.fixture(scope="session")
def training_image() -> Iterator[Callable[[str, str], str]]:
    """A training image for (torch release, Python minor), built here when it is missing."""
    built: Dict[Tuple[str, str], str] = {}

    def get(torch: str, python: str) -> str:
        if (torch, python) not in built:
            built[(torch, python)] = _built(lambda: images.training_image(torch, python))
        return built[(torch, python)]

    yield get


def _built(make: Callable[[], str]) -> str:
    try:
        return make()
    except images.ImageBuildFailed as err:
        pytest.fail(str(err))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in images.summary().splitlines():
        terminalreporter.write_line(line)
