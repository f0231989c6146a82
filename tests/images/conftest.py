"""The image tests (#29): the project's image built from the Dockerfile and training images
standing for users', run under podman the way the chart and an estimation pod run them.

They build images (minutes, several GB), so they are not part of `make test`: `make image-test`
builds the images and runs them with XMEM_IMAGE_TESTS=1. Without it this folder is not collected.
Each fixture reuses an image that exists already (the build scripts do); the containers and
volumes a test makes are removed by it. `podman rmi` the images listed by `podman images
localhost/xmem-*` to free their disk.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple

import pytest

from tests.realkube.podman_pod import image_size, podman_ready

ROOT = Path(__file__).resolve().parents[2]
ENABLED = os.environ.get("XMEM_IMAGE_TESTS") == "1"
collect_ignore_glob = [] if ENABLED else ["test_*.py"]

SIZES: Dict[str, int] = {}  # image -> bytes, printed at the end of the run


@dataclass(frozen=True)
class ProjectImage:
    reference: str
    context: Path  # the build context: what the Dockerfile copied, as it was at the build


def _build(*command: str, env: Optional[Mapping[str, str]] = None) -> str:
    """Run an image build script; its last line of output is the image's reference."""
    reason = podman_ready()
    if reason:
        pytest.fail(reason)
    result = subprocess.run(["bash", *command], cwd=ROOT, capture_output=True, text=True,
                            timeout=3600, env=dict(os.environ, **(env or {})))
    assert result.returncode == 0, result.stderr[-4000:]
    reference = result.stdout.strip().splitlines()[-1]
    SIZES[reference] = image_size(reference)
    return reference


@pytest.fixture(scope="session")
def project_build(tmp_path_factory: pytest.TempPathFactory) -> ProjectImage:
    """The project's image (`make image`), from a copy of the files its Dockerfile copies (the
    sources may change while it builds); the layers of an unchanged copy are reused."""
    context = tmp_path_factory.mktemp("context")
    for name in ("pyproject.toml", "README.md", ".dockerignore"):
        shutil.copy2(ROOT / name, context / name)
    shutil.copytree(ROOT / "src", context / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    reference = _build("scripts/build-image.sh", env={"XMEM_BUILD_CONTEXT": str(context)})
    return ProjectImage(reference, context)


@pytest.fixture(scope="session")
def project_image(project_build: ProjectImage) -> str:
    return project_build.reference


@pytest.fixture(scope="session")
def training_image() -> Iterator[Callable[[str, str], str]]:
    """A training image for (torch release, Python minor), built here when it is missing."""
    built: Dict[Tuple[str, str], str] = {}

    def get(torch: str, python: str) -> str:
        if (torch, python) not in built:
            built[(torch, python)] = _build("scripts/training-image.sh", torch, python)
        return built[(torch, python)]

    yield get


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for reference, size in sorted(SIZES.items()):
        terminalreporter.write_line(f"image {reference}: {size / 1e6:.0f} MB")
