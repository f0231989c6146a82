"""Injected failures of the stand-in API server: the 429s, 5xx and 409s a real one gives.

``server.faults.add(status=429, method="PATCH", path="/jobs/", retry_after=2)`` answers the next
matching request with that status instead of handling it (``when="before"``), or handles it and
then answers the error (``when="after"``: the write landed but the client saw a failure, which
is what a timeout or a dropped connection looks like to a controller). Rules are consumed in the
order they were added; ``times=-1`` matches forever; ``hits`` counts what each one caught.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class Fault:
    """One injected failure; ``times`` < 0 means every matching request."""

    status: int
    method: str = "*"
    path: str = ""  # a regular expression searched in the request path
    times: int = 1
    retry_after: Optional[int] = None
    when: str = "before"  # "before": not handled at all; "after": handled, then the error
    message: str = ""
    hits: int = 0

    def matches(self, method: str, path: str, when: str) -> bool:
        return (self.times != 0 and self.when == when and self.method in ("*", method)
                and re.search(self.path, path) is not None)


@dataclass
class Faults:
    """The injected failures of a server, consumed in the order they were added."""

    rules: List[Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, status: int, method: str = "*", path: str = "", times: int = 1,
            retry_after: Optional[int] = None, when: str = "before", message: str = "") -> Fault:
        fault = Fault(status, method.upper(), path, times, retry_after, when, message)
        with self.lock:
            self.rules.append(fault)
        return fault

    def take(self, method: str, path: str, when: str) -> Optional[Fault]:
        with self.lock:
            for fault in self.rules:
                if fault.matches(method, path, when):
                    fault.times -= 1 if fault.times > 0 else 0
                    fault.hits += 1
                    return fault
        return None

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
