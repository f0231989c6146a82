"""Exceptions of the stand-in cluster (never raised by the product)."""

from __future__ import annotations


class ApiStatusError(Exception):
    """Raised inside the stand-in API server (``tests.fakekube``) to answer with a Status."""

    def __init__(self, code: int, reason: str, message: str,
                 details: dict | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}
        self.headers = headers or {}
