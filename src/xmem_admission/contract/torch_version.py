"""Which torch a trace was made with, and which torch releases the probe supports.

The probe runs inside the user's image with the user's torch, so a version string can be any
that a vendor builds: PyPI's ``2.6.0`` and ``2.14.1+cu130``, a source build's
``2.6.0a0+ecf3bae40a``, NVIDIA's NGC containers' ``2.6.0a0+ecf3bae40a.nv25.01``, a nightly's
``2.16.0.dev20261201+cpu``, ROCm's ``2.5.1+rocm6.2``. Only the release (major, minor, patch)
decides behaviour; a pre-release (``a0``, ``.dev``) of 2.6 behaves as 2.6 is going to.

Standard library only: the probe bundle (Python >= 3.9) and the cluster side both read this.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from xmem_admission.contract.errors import XmemError


class TorchVersionError(XmemError):
    """Raised when a torch version string has no ``MAJOR.MINOR`` release to read."""


class TorchVersion(NamedTuple):
    """A torch release as (major, minor, patch); ``text`` keeps what torch itself said."""

    major: int
    minor: int
    patch: int
    text: str

    @property
    def release(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def __str__(self) -> str:
        return self.text


# PEP 440 as torch's builds spell it: the release, then anything (pre-release, dev, local).
_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")

# The oldest and newest releases the probe is tested with (`make compat`, bench/coverage/README.md "The
# user's torch": every minor release between them, each with the oldest and newest Python it
# supports). Older ones are refused with this range; a newer one is traced (what breaks there
# is reported as the script's error, with torch's traceback).
OLDEST = (2, 2)
NEWEST = (2, 15)


def parse(text: object) -> TorchVersion:
    """``torch.__version__`` (a ``TorchVersion`` str subclass, or any string) -> its release."""
    value = str(text) if text is not None else ""
    match = _RELEASE.match(value)
    if match is None:
        raise TorchVersionError(f"torch version {value!r} names no MAJOR.MINOR release")
    patch = int(match.group(3)) if match.group(3) is not None else 0
    return TorchVersion(int(match.group(1)), int(match.group(2)), patch, value.strip())


def supported_range() -> str:
    """The supported releases, as people write them: ``2.2 to 2.15``."""
    return f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def unsupported_reason(text: object) -> Optional[str]:
    """Why the probe cannot trace with this torch, or None when it can.

    Newer than ``NEWEST`` is traced (a release that changes what the probe stands on fails
    with its own error, reported as a script error with the traceback); older than ``OLDEST`` is
    refused, since the probe is known not to run there.
    """
    try:
        version = parse(text)
    except TorchVersionError as exc:
        return str(exc)
    if version.release < OLDEST:
        return (f"torch {version.text} is older than the probe supports (torch "
                f"{supported_range()}): estimate the job with an image whose torch is "
                f"{OLDEST[0]}.{OLDEST[1]} or newer")
    return None

