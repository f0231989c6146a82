"""Every exception the project raises on purpose, in one place.

Each class says in one line when it is raised. The CLI turns any ``XmemError`` into a one-line
message on stderr and a non-zero exit; nothing here should ever surface as a traceback.
Standard library only: this module is part of the probe bundle.
"""

from __future__ import annotations


class XmemError(Exception):
    """Base class: raised for any input or situation the user must fix (never a bug)."""

    exit_code = 2


class TraceError(XmemError):
    """Raised when an allocation trace file is unreadable, malformed or inconsistent."""


class UnknownGPUError(XmemError):
    """Raised when a GPU name matches no model in the GPU catalogue (the message lists them)."""
