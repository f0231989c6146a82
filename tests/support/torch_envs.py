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
