"""A thin proxy in front of the real API server that answers chosen requests with a fault.

A healthy API server never answers 429 or 500 on demand, yet clients must survive both. The proxy
listens on loopback (plain HTTP: the client's bearer token passes through untouched), forwards
every request to the API server over TLS (verifying it with the cluster CA), and streams the
answer back (watches included, chunk by chunk). ``inject(method, path_pattern, status, times)``
makes the next ``times`` matching requests answer ``status`` without reaching the server (a 429
carries ``Retry-After: 1``); ``seen`` records every request with the status it got.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import ssl
import threading
from dataclasses import dataclass
from typing import List, Optional, Tuple

from tests.realkube.controlplane import LOOPBACK, free_port

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "host"}
REASONS = {429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
           409: "Conflict"}


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    times: int


class FaultProxy:
    """See the module docstring."""

    def __init__(self, upstream_port: int, ca_file: str) -> None:
        self.upstream_port = upstream_port
        self.context = ssl.create_default_context(cafile=ca_file)
        self.faults: List[Fault] = []
        self.seen: List[Tuple[str, str, int]] = []
        self.lock = threading.Lock()
        self.port = free_port()
        self._server: Optional[http.server.ThreadingHTTPServer] = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def inject(self, method: str, path: str, status: int, times: int = 1) -> None:
        with self.lock:
            self.faults.append(Fault(method.upper(), re.compile(path), status, times))

    def injected(self) -> List[Tuple[str, str, int]]:
        """The requests the proxy answered with a fault itself."""
        with self.lock:
            return [s for s in self.seen if s[2] in REASONS and s[2] != 409]

    def _take(self, method: str, path: str) -> Optional[int]:
        with self.lock:
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and fault.path.search(path):
                    fault.times -= 1
                    return fault.status
        return None

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                method = self.command
                status = proxy._take(method, self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if status is not None:
                    with proxy.lock:
                        proxy.seen.append((method, self.path, status))
                    self._fault(status)
                    return
                upstream = http.client.HTTPSConnection(LOOPBACK, proxy.upstream_port,
                                                       context=proxy.context, timeout=600)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                try:
                    upstream.request(method, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                except OSError:
                    self._fault(503)
                    return
                with proxy.lock:
                    proxy.seen.append((method, self.path, answer.status))
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
                except OSError:
                    self.close_connection = True
                finally:
                    upstream.close()

            def _fault(self, status: int) -> None:
                reason = REASONS.get(status, "InternalError")
                payload = json.dumps({
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": f"injected by the test's fault proxy: {reason}",
                    "reason": reason, "code": status}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                if status == 429:
                    self.send_header("Retry-After", "1")
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
