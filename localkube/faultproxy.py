"""A thin proxy in front of the real API server that answers chosen requests with a fault.

A healthy API server never answers 429 or 500 on demand, yet clients must survive both. The proxy
listens on loopback (plain HTTP: the client's bearer token passes through untouched), forwards
every request to the API server over TLS (verifying it with the cluster CA), and streams the
answer back (watches included, chunk by chunk). ``inject(method, path_pattern, status, times)``
makes the next ``times`` matching requests answer ``status`` without reaching the server (a 429
carries ``Retry-After``, 1 s unless told); with ``when="after"`` the request reaches the server
and is carried out, and the client gets the fault instead of the answer (a write that landed but
whose answer was lost). Patterns are searched in the path without its query string; ``times`` < 0
means every matching request; ``query``, when given, must also appear in the query string (a
list's ``continue=``). ``seen`` records every request with the status it got, and each
``on_request`` observer is called with ``(method, path, status)`` once the status is known.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import ssl
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple
from urllib.parse import urlsplit

from localkube.controlplane import LOOPBACK, free_port

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "host"}
REASONS = {429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
           409: "Conflict", 410: "Expired"}


Observer = Callable[[str, str, int], None]


@dataclass
class Fault:
    method: str  # "*": any
    path: re.Pattern[str]
    status: int
    times: int
    retry_after: Optional[int] = 1  # None: a 429 without Retry-After
    when: str = "before"  # "before": never reaches the server; "after": carried out, then this
    message: str = ""
    hits: int = 0
    query: str = ""


class FaultProxy:
    """See the module docstring."""

    def __init__(self, upstream_port: int, ca_file: str) -> None:
        self.upstream_port = upstream_port
        self.context = ssl.create_default_context(cafile=ca_file)
        self.faults: List[Fault] = []
        self.seen: List[Tuple[str, str, int]] = []
        self.answered: List[Tuple[str, str, int]] = []  # the faults the proxy answered
        self.observers: List[Observer] = []
        self.lock = threading.Lock()
        self.port = free_port()
        self._server: Optional[http.server.ThreadingHTTPServer] = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def inject(self, method: str, path: str, status: int, times: int = 1,
               retry_after: Optional[int] = 1,
               when: str = "before", message: str = "", query: str = "") -> Fault:
        fault = Fault(method.upper(), re.compile(path), status, times, retry_after, when, message,
                      query=query)
        with self.lock:
            self.faults.append(fault)
        return fault

    def on_request(self, observer: Observer) -> None:
        self.observers.append(observer)

    def _record(self, method: str, path: str, status: int, fault: bool = False) -> None:
        with self.lock:
            self.seen.append((method, path, status))
            if fault:
                self.answered.append((method, path, status))
            observers = list(self.observers)
        for observer in observers:
            observer(method, urlsplit(path).path, status)

    def injected(self) -> List[Tuple[str, str, int]]:
        """The requests the proxy answered with a fault itself."""
        with self.lock:
            return list(self.answered)

    def _take(self, method: str, path: str, when: str) -> Optional[Fault]:
        parts = urlsplit(path)
        with self.lock:
            for fault in self.faults:
                if fault.times != 0 and fault.when == when and fault.method in ("*", method) \
                        and fault.path.search(parts.path) and fault.query in parts.query:
                    fault.times -= 1 if fault.times > 0 else 0
                    fault.hits += 1
                    return fault
        return None

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                method = self.command
                fault = proxy._take(method, self.path, "before")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if fault is not None:
                    proxy._record(method, self.path, fault.status, fault=True)
                    self._fault(fault)
                    return
                upstream = http.client.HTTPSConnection(LOOPBACK, proxy.upstream_port,
                                                       context=proxy.context, timeout=600)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                try:
                    upstream.request(method, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                except OSError:
                    self._fault(Fault(method, re.compile(""), 503, 0))
                    return
                late = proxy._take(method, self.path, "after")
                if late is not None:
                    answer.read()
                    upstream.close()
                    proxy._record(method, self.path, late.status, fault=True)
                    self._fault(late)
                    return
                proxy._record(method, self.path, answer.status)
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    while True:
                        chunk = answer.read1(65536)
                        if not chunk:
                            break
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (OSError, http.client.HTTPException):  # either side closed the stream
                    self.close_connection = True
                finally:
                    upstream.close()

            def _fault(self, fault: Fault) -> None:
                status = fault.status
                reason = REASONS.get(status, "InternalError")
                payload = json.dumps({
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": fault.message or f"injected by the test's fault proxy: {reason}",
                    "reason": reason, "code": status}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                if status == 429 and fault.retry_after is not None:
                    self.send_header("Retry-After", str(fault.retry_after))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((LOOPBACK, self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="fault-proxy").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
