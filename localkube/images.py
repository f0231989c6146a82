"""Images for the tests that run real containers (``tests/images``, ``tests/realnode``): the
project's image and training images, built through the project's scripts, which reuse an image
that exists already in podman's store.

``build(script, *args)`` runs one (its last line of output is the image's reference) and records
the image's size in ``SIZES`` for the run's summary. ``project_image(context)`` builds the
project's Dockerfile from a copy of what it copies, taken at one instant (the sources may change
while it builds). ``training_image(torch, python)`` builds one standing for a user's image.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Mapping, Optional

from localkube.podman_pod import image_size, podman_ready
from localkube.tools import ROOT

SIZES: Dict[str, int] = {}  # image -> bytes, printed at the end of a run


class ImageBuildFailed(AssertionError):
    pass


def build(script: str, *args: str, env: Optional[Mapping[str, str]] = None,
          timeout: float = 3600) -> str:
    reason = podman_ready()
    if reason:
        raise ImageBuildFailed(reason)
    result = subprocess.run(["bash", f"scripts/{script}", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    if result.returncode != 0:
        raise ImageBuildFailed(f"scripts/{script} {' '.join(args)} failed:\n"
                               f"{result.stderr[-4000:]}")
    reference = result.stdout.strip().splitlines()[-1]
    SIZES[reference] = image_size(reference)
    return reference


def project_image(context: Path) -> str:
    """``make image`` from a copy of the files the Dockerfile copies, made in ``context``; the
    layers of an unchanged copy are reused. Its base is made here from Debian's packages when
    no registry serves python:3.11-slim-bookworm (scripts/build-image.sh)."""
    for name in ("pyproject.toml", "README.md", ".dockerignore"):
        shutil.copy2(ROOT / name, context / name)
    shutil.copytree(ROOT / "src", context / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return build("build-image.sh", env={"XMEM_BUILD_CONTEXT": str(context)})


def training_image(torch: str, python: str) -> str:
    """Debian's Python ``python`` (3.9, 3.11 or 3.13) with torch ``torch`` from PyPI."""
    return build("training-image.sh", torch, python)


def summary() -> str:
    return "\n".join(f"image {reference}: {size / 1e6:.0f} MB"
                     for reference, size in sorted(SIZES.items()))


def derived(base: str, tag: str, lines: str, files: Optional[Mapping[str, str]] = None) -> str:
    """An image made from ``base`` by the Containerfile ``lines`` after its FROM, with ``files``
    (name -> text) in the build context; tagged ``localhost/xmem-test:<tag>-<hash>`` (the hash
    of all of it), reused when it exists. No layer of ``base`` is copied."""
    import hashlib
    import tempfile

    containerfile = f"FROM {base}\n{lines}"
    digest = hashlib.sha256(repr((containerfile, sorted((files or {}).items()))).encode())
    reference = f"localhost/xmem-test:{tag}-{digest.hexdigest()[:12]}"
    podman = ["podman", "--runtime", "runc"]
    if subprocess.run([*podman, "image", "exists", reference]).returncode == 0:
        return reference
    with tempfile.TemporaryDirectory() as context:
        for name, text in (files or {}).items():
            (Path(context) / name).write_text(text)
        (Path(context) / "Containerfile").write_text(containerfile)
        result = subprocess.run([*podman, "build", "--pull=never", "--quiet", "--ulimit",
                                 "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "-t",
                                 reference, context], capture_output=True, text=True,
                                timeout=600)
    if result.returncode != 0:
        raise ImageBuildFailed(f"the image {reference} failed to build:\n{result.stderr[-4000:]}")
    SIZES[reference] = image_size(reference)
    return reference
