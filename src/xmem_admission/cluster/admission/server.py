"""Running the webhook: TLS admission port and plain-HTTP health port, under uvicorn.

Both ports are served by one event loop in one process. The serving certificate is reloaded
when its files change on disk (cert-manager and the chart's hook rotate them in place): the
``ssl.SSLContext`` the listener uses is updated with ``load_cert_chain``, which applies to every
new handshake, so rotation needs no restart and drops no connection. A half-written pair that
fails to load is retried on the next check while the old certificate keeps serving. The same
periodic task refreshes the policy source (a file or the cluster object), in a worker thread,
and, with the chart's self-signed certificate, has ``certificates.Rotator`` renew it in its
Secret before expiry and serve the Secret's pair as soon as it changes (no wait for the kubelet
to update the mounted files).

Slow clients cannot hold a replica: a connection must deliver a request's headers within
``header_seconds`` of opening (or of its first byte after a keep-alive pause), else it is
closed, as is one whose request line and headers pass ``MAX_HEADER_BYTES``; the body has its
own deadline (``app.BODY_SECONDS``) and size limit, checked as it streams in; an idle keep-alive
connection is closed after 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from xmem_admission.cluster.admission.app import (
    BODY_SECONDS,
    create_admission_app,
    create_health_app,
)
from xmem_admission.cluster.admission.webhook import Webhook
from xmem_admission.cluster.policy.sources import PolicySource
from xmem_admission.contract.errors import ServeError

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """Where and how to serve."""

    cert_file: str
    key_file: str
    host: str = "0.0.0.0"
    port: int = 8443
    metrics_port: int = 8080
    reload_seconds: float = 2.0  # how often certificate and policy are checked for changes
    log_level: str = "info"
    header_seconds: float = 10.0  # a request's headers must arrive within this
    body_seconds: float = BODY_SECONDS  # ... and its body within this


def _stamp(paths: Tuple[str, ...]) -> Tuple[Any, ...]:
    out = []
    for path in paths:
        info = os.stat(path)  # follows the ..data symlink of a mounted Secret
        out.append((info.st_mtime_ns, info.st_size, info.st_ino))
    return tuple(out)


def _not_after(cert_file: str) -> float:
    """When the first certificate of a PEM file expires (Unix time); 0 when unreadable."""
    from cryptography import x509

    try:
        with open(cert_file, "rb") as handle:
            return x509.load_pem_x509_certificate(handle.read()).not_valid_after_utc.timestamp()
    except (OSError, ValueError) as exc:
        log.warning("cannot read the expiry of %s: %s", cert_file, exc)
        return 0.0


class ReloadingTLS:
    """A server ``SSLContext`` whose certificate follows the files on disk."""

    def __init__(self, cert_file: str, key_file: str):
        self.cert_file = cert_file
        self.key_file = key_file
        for path in (cert_file, key_file):
            if not os.path.isfile(path):
                raise ServeError(f"{path}: no such file (pass --cert-file and --key-file)")
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.set_alpn_protocols(["http/1.1"])
        try:
            self._stamp = _stamp((cert_file, key_file))
            self.context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ServeError(f"cannot load certificate {cert_file} with key {key_file}: {exc}") from None
        self.reloads = 0
        self.not_after = _not_after(cert_file)

    def use(self, cert_file: str, key_file: str) -> bool:
        """Serve this pair from now on (the rotator's, from the Secret); False if it does not
        load, the current one serving on."""
        try:
            self.context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            log.warning("renewed certificate does not load, keeping the current one: %s", exc)
            return False
        self.reloads += 1
        self.not_after = _not_after(cert_file)
        log.info("serving the renewed certificate, valid until %s",
                 time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.not_after)))
        return True

    def check(self) -> bool:
        """Reload if either file changed; True when a new certificate was loaded."""
        try:
            stamp = _stamp((self.cert_file, self.key_file))
        except OSError as exc:
            log.warning("certificate files unreadable, keeping the current one: %s", exc)
            return False
        if stamp == self._stamp:
            return False
        try:
            self.context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:  # mid-rotation: try again next time
            log.warning("new certificate does not load yet, keeping the current one: %s", exc)
            return False
        self._stamp = stamp
        self.reloads += 1
        self.not_after = _not_after(self.cert_file)
        log.info("serving certificate reloaded from %s", self.cert_file)
        return True


MAX_HEADER_BYTES = 64 * 1024  # request line and headers; the API server sends well under 4 KiB


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on a request's headers (armed when the
    connection opens and when a request begins, cleared once its headers are complete) and a
    bound on their size."""

    header_seconds = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._header_bytes = 0
        super().connection_made(transport)
        self._arm()

    def _count(self, size: int) -> bool:
        self._header_bytes += size
        if self._header_bytes <= MAX_HEADER_BYTES:
            return True
        if not self.transport.is_closing():
            log.info("closing a connection whose request headers passed %d bytes",
                     MAX_HEADER_BYTES)
            self.transport.close()
        return False

    def on_url(self, url: bytes) -> None:
        if self._count(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._count(len(name) + len(value)):
            super().on_header(name, value)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closing a connection whose request headers took over %.0f s",
                     self.header_seconds)
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)


def _timed_protocol(seconds: float) -> type:
    return type("TimedHttpProtocol", (TimedHttpProtocol,), {"header_seconds": seconds})


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to us: two servers share one process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_config(app: Any, log_level: str, header_seconds: float) -> uvicorn.Config:
    """The settings both servers share: no logging config or access log of uvicorn's, no
    lifespan, httptools with a header deadline."""
    return uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                          http=_timed_protocol(header_seconds), log_level=log_level,
                          timeout_keep_alive=30)


class AdmissionServer:
    """The admission and health servers of one ``xmem serve`` process."""

    def __init__(self, webhook: Webhook, policy: PolicySource, config: ServeConfig,
                 rotator: Optional[Any] = None, rotated: Optional[Any] = None,
                 rotate_seconds: float = 60.0):
        """``rotator``: a ``certificates.Rotator`` checked every ``rotate_seconds``, writing
        the Secret's pair into ``rotated`` (a ``certificates.FilePair``), which is served."""
        self.webhook = webhook
        self.rotator, self.rotated, self.rotate_seconds = rotator, rotated, rotate_seconds
        self.policy = policy
        self.config = config
        self.tls = ReloadingTLS(config.cert_file, config.key_file)
        webhook.metrics.certificate_expiry.set(self.tls.not_after)
        self.admission_socket = bind(config.host, config.port)
        self.health_socket = bind(config.host, config.metrics_port)
        admission = _uvicorn_config(create_admission_app(webhook, config.body_seconds),
                                    config.log_level, config.header_seconds)
        admission.load()
        admission.ssl = self.tls.context  # ours, so that reloads reach the live listener
        health = _uvicorn_config(create_health_app(webhook.metrics, self.readiness),
                                 config.log_level, config.header_seconds)
        self._servers: List[_Server] = [_Server(admission), _Server(health)]

    @property
    def ports(self) -> Tuple[int, int]:
        """(admission port, health port) actually bound."""
        return (self.admission_socket.getsockname()[1], self.health_socket.getsockname()[1])

    @property
    def started(self) -> bool:
        return all(s.started for s in self._servers)

    def readiness(self) -> Tuple[bool, str]:
        if not self.started:
            return False, "starting"
        if self.policy.current() is None:
            return False, f"no policy loaded: {self.policy.error}"
        return True, "ready"

    def stop(self) -> None:
        for server in self._servers:
            server.should_exit = True

    async def _rotate(self) -> None:
        """Check the certificate's Secret (API calls, in a worker thread); serve a new pair
        here, on the event loop's thread, where handshakes read the context."""
        if self.rotator is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.rotator.check)
        except Exception as exc:  # noqa: BLE001 - the policy refresh must go on whatever fails
            log.warning("certificate check failed: %s: %s", type(exc).__name__, exc)
            return
        if self.rotated is not None and self.rotated.pending:
            self.rotated.pending = False
            if self.tls.use(self.rotated.cert_file, self.rotated.key_file):
                self.webhook.metrics.certificate_expiry.set(self.tls.not_after)

    async def _refresh(self) -> None:
        rotated_at = time.monotonic() - self.rotate_seconds  # the first check comes at once
        while not self._servers[0].should_exit:
            await asyncio.sleep(self.config.reload_seconds)
            if self.tls.check():
                self.webhook.metrics.certificate_expiry.set(self.tls.not_after)
            if time.monotonic() - rotated_at >= self.rotate_seconds:
                rotated_at = time.monotonic()
                await self._rotate()
            await asyncio.get_running_loop().run_in_executor(None, self.policy.refresh)

    async def serve(self) -> None:
        """Serve until ``stop`` is called (or SIGTERM/SIGINT in the main thread)."""
        loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        await loop.run_in_executor(None, self.policy.refresh)
        refresher = asyncio.ensure_future(self._refresh())
        try:
            await asyncio.gather(
                self._servers[0].serve(sockets=[self.admission_socket]),
                self._servers[1].serve(sockets=[self.health_socket]),
            )
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            self.admission_socket.close()
            self.health_socket.close()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (the server extra has it), asyncio's loop otherwise."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(server: AdmissionServer) -> None:
    """Serve in this thread until stopped."""
    # Everything built so far (FastAPI, uvicorn, the catalogue) lives as long as the process:
    # moving it out of the collector's sight keeps full collections, triggered by the dicts
    # each 20 KB review allocates, from pausing an admission for milliseconds.
    gc.collect()
    gc.freeze()
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(server.serve())
    finally:
        loop.close()


class ServerThread:
    """An ``AdmissionServer`` in a background thread: for tests and embedding."""

    def __init__(self, server: AdmissionServer):
        self.server = server
        self._thread = threading.Thread(target=run, args=(server,), name="xmem-serve", daemon=True)

    def start(self, timeout: float = 20.0) -> ServerThread:
        self._thread.start()
        deadline = timeout
        while not self.server.started and deadline > 0:
            if not self._thread.is_alive():
                raise ServeError("the server stopped while starting")
            self._thread.join(0.02)
            deadline -= 0.02
        if not self.server.started:
            raise ServeError(f"the server did not start within {timeout} s")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.stop()
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Optional[BaseException]) -> None:
        self.stop()
