"""The ASGI apps: admission (``/mutate``, ``/validate``) and health (``/metrics``, ``/healthz``,
``/readyz``), kept apart so admission can sit behind TLS and health stay plain HTTP for kubelet
probes and Prometheus.

The handlers are thin on purpose: read the body, hand the bytes to ``Webhook.review``, send back
what it returns with HTTP 200 (the API server reads the verdict from the review, and treats any
other status as a failed call). The body is read as bytes and never parsed by the framework;
its size is checked while it streams in (a chunked body is never buffered past the limit) and
it must arrive within ``BODY_SECONDS`` (the header deadline is the server's: ``server.py``).
A review of up to ``INLINE_BYTES`` (every ordinary one) is answered on the event loop, where it
takes a millisecond or so; a larger one (a maximal object and its old version on UPDATE) is
answered in a worker thread, so parsing megabytes never holds up the other connections.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from xmem_admission.cluster.admission import response
from xmem_admission.cluster.admission.metrics import AdmissionMetrics
from xmem_admission.cluster.admission.response import Decision, Verdict
from xmem_admission.cluster.admission.webhook import Endpoint, Scope, Webhook

# The API server caps request bodies at 3 MiB (etcd's object limit is 1.5 MiB); anything far
# beyond is not from an API server.
MAX_BODY_BYTES = 8 * 1024 * 1024
BODY_SECONDS = 10.0  # the API server sends a review at once; its own timeout is 30 s at most
INLINE_BYTES = 256 * 1024  # larger reviews are answered off the event loop
JSON = "application/json"

# The paths each endpoint answers on, and which webhook entry each one stands for.
ROUTES = (("", Scope.OBJECT), ("/object", Scope.OBJECT), ("/namespace", Scope.NAMESPACE))


def _too_large() -> bytes:
    return response.build("", Verdict(
        Decision.ERRORED, code=413, reason="RequestEntityTooLarge",
        message=f"admission review larger than {MAX_BODY_BYTES} bytes",
    ))


def _too_slow(seconds: float) -> bytes:
    return response.build("", Verdict(
        Decision.ERRORED, code=408, reason="Timeout",
        message=f"admission review body not received within {seconds:g} s",
    ))


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> Optional[bytes]:
    """The body, or None as soon as more than ``limit`` bytes have arrived."""
    length = request.headers.get("content-length")
    if length is not None and length.isascii() and length.isdigit() and \
            (len(length) > 12 or int(length) > limit):
        return None
    chunks: List[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def create_admission_app(webhook: Webhook, body_seconds: float = BODY_SECONDS) -> FastAPI:
    """The TLS app the API server calls."""
    app = FastAPI(title="xmem admission", docs_url=None, redoc_url=None, openapi_url=None)
    # One worker: large reviews are answered one at a time, in arrival order, off the loop.
    large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xmem-large-review")

    def route(endpoint: Endpoint, scope: Scope) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            try:
                body = await asyncio.wait_for(read_body(request), body_seconds)
            except asyncio.TimeoutError:
                return Response(_too_slow(body_seconds), media_type=JSON,
                                headers={"Connection": "close"})
            if body is None:
                return Response(_too_large(), media_type=JSON, headers={"Connection": "close"})
            if len(body) > INLINE_BYTES:
                answer = await asyncio.get_running_loop().run_in_executor(
                    large, webhook.review, body, endpoint, scope)
                return Response(answer, media_type=JSON)
            return Response(webhook.review(body, endpoint, scope), media_type=JSON)

        return handle

    for endpoint in Endpoint:
        for suffix, scope in ROUTES:
            app.add_api_route(
                f"/{endpoint.value}{suffix}", route(endpoint, scope), methods=["POST"],
                include_in_schema=False,
            )
    return app


ReadyCheck = Callable[[], Tuple[bool, str]]


def create_health_app(metrics: AdmissionMetrics, ready: Optional[ReadyCheck] = None) -> FastAPI:
    """The plain-HTTP app for kubelet probes and Prometheus."""
    app = FastAPI(title="xmem health", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        # Answering at all proves the event loop is alive, which is what liveness asks.
        return PlainTextResponse("ok\n")

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> Response:
        ok, why = ready() if ready is not None else (True, "ready")
        return PlainTextResponse(why + "\n", status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
