"""The users' torch releases the tests run the probe with, besides the development pin.

Each is a virtual environment built by ``scripts/torch-venv.sh VERSION PYTHON`` (``make test``
builds the two below before pytest starts; ``make compat`` builds every minor release of the
supported range). A test that needs one and does not find it fails with the command that builds
it: CI builds them first, so a missing one there is a failure, never a skip.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XMEM_TORCH_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
             / "xmem-admission" / "torch")


class TorchEnv(NamedTuple):
    torch: str
    python: str

    @property
    def folder(self) -> Path:
        return CACHE / f"torch-{self.torch}-py{self.python}"

    @property
    def interpreter(self) -> str:
        """The environment's ``bin/python``; fails (never skips) when it was not built."""
        if not (self.folder / ".complete").is_file():
            raise AssertionError(
                f"no torch {self.torch} environment with Python {self.python} at {self.folder}: "
                f"build it with `bash scripts/torch-venv.sh {self.torch} {self.python}` "
                f"(`make test` does)")
        return str(self.folder / "bin" / "python")

    def frameworks(self) -> set[str]:
        """The conformance corpus's frameworks that installed beside this torch."""
        path = self.folder / "frameworks.txt"
        return set(path.read_text().split()) if path.is_file() else set()

    def build(self) -> str:
        """Build the environment if it is not there (minutes) and return its interpreter."""
        subprocess.run(["bash", str(ROOT / "scripts" / "torch-venv.sh"), self.torch, self.python],
                       check=True, stdout=subprocess.DEVNULL)
        return self.interpreter


# The oldest supported torch with the oldest Python it supports, and the newest with the newest:
# the two ends of the range that `make test` runs the probe's tests with.
OLDEST = TorchEnv("2.2.2", "3.9")
NEWEST = TorchEnv("2.15.0", "3.13")


def _in_a_users_env() -> bool:
    """Running the probe's tests with a user's torch (scripts/test-torch.sh), not the pin."""
    return bool(os.environ.get("XMEM_TORCH_ENV"))


def _running() -> str:
    import sys

    import torch

    return f"torch {torch.__version__} on Python {sys.version_info[0]}.{sys.version_info[1]}"


def require_module(module: str) -> None:
    """A test whose script imports a framework beside torch (torchvision, timm, ...): in a
    user's torch environment where that framework does not install, the test says so and is
    left out; in the development environment every framework is installed, and a missing one
    fails the test where the script imports it."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(module) is None and _in_a_users_env():
        pytest.skip(f"{module} does not install beside {_running()} (its pin needs another)")


def require_torch_save() -> None:
    """A test whose script writes a checkpoint: in a user's torch environment where torch.save
    itself fails, without the probe (torch 2.5 on Python 3.13.0: the C pickler's persistent_id
    is read-only there), the test says so and is left out; with the pin it always runs."""
    import io

    import pytest
    import torch

    if not _in_a_users_env():
        return
    try:
        torch.save({"w": torch.zeros(1)}, io.BytesIO())
    except Exception as error:  # noqa: BLE001 - whatever torch.save raises here, said as is
        pytest.skip(f"torch.save fails with {_running()} without the probe: "
                    f"{type(error).__name__}: {error}")
