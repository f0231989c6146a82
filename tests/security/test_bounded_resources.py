"""What a client that is not the API server can make a replica spend, and for how long: bounded.

The real server over TLS on loopback, with short header and body deadlines so the tests wait
on them briefly. Each test waits on the server's own reaction (an answer, a closed connection),
never on a fixed sleep.
"""

from __future__ import annotations

import json
import socket
import ssl
from typing import Iterator

import pytest

from tests.support.builders import make_job, make_pod, review
from tests.support.estimates import record_for
from tests.support.harness import Certificates, HttpsWebhook, make_policy
from xmem_admission.cluster.admission.app import MAX_BODY_BYTES
from xmem_admission.cluster.admission.metrics import LABEL_CHARS, WORKLOAD_SERIES, AdmissionMetrics
from xmem_admission.cluster.admission.server import MAX_HEADER_BYTES

DEADLINE = 1.0  # the header and body deadlines of the server under test, in seconds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpsWebhook]:
    served = HttpsWebhook(make_policy(enforcement="Enforce"),
                          Certificates(tmp_path_factory.mktemp("tls")),
                          header_seconds=DEADLINE, body_seconds=DEADLINE)
    try:
        yield served
    finally:
        served.close()


def _connect(server: HttpsWebhook) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10 * DEADLINE)
    return server.certs.client_context().wrap_socket(raw, server_hostname="localhost")


def _answer(tls: ssl.SSLSocket) -> bytes:
    """Everything the server sends until it closes the connection (or a complete answer)."""
    data = b""
    while True:
        try:
            chunk = tls.recv(65536)
        except (ConnectionResetError, ssl.SSLError):
            return data
        if not chunk:
            return data
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:")]
        if length and len(body) >= length[0]:
            return data


def test_a_chunked_body_beyond_the_limit_is_refused_before_the_client_finishes_sending(server):
    """The server answers 413 once the limit has streamed in; a server that buffered the whole
    body first would still be waiting for the rest (and answer 408 at the body deadline)."""
    tls = _connect(server)
    tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b" " * (1 << 20)
    for _ in range(MAX_BODY_BYTES // len(chunk) + 1):
        tls.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    answer = _answer(tls)  # the terminating chunk is never sent
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    status = json.loads(answer.partition(b"\r\n\r\n")[2])["response"]["status"]
    assert status["code"] == 413


def test_a_client_that_never_finishes_its_headers_is_disconnected(server):
    tls = _connect(server)
    tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\n")
    assert _answer(tls) == b""  # closed without an answer once the header deadline passed


def test_a_client_that_sends_nothing_is_disconnected(server):
    assert _answer(_connect(server)) == b""


def test_headers_beyond_their_limit_close_the_connection(server):
    tls = _connect(server)
    tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\n")
    for index in range(MAX_HEADER_BYTES // 1000 + 2):
        try:
            tls.sendall(b"X-Padding-%d: %s\r\n" % (index, b"p" * 1000))
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            break
    assert b"200" not in _answer(tls)[:20]


def test_a_body_that_stops_arriving_gets_a_408(server):
    tls = _connect(server)
    tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{\"kind\":")
    answer = _answer(tls)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["response"]["status"]["code"] == 408


def test_a_review_made_of_tiny_json_values_is_refused_before_it_is_parsed(server):
    body = b'{"a":[' + b"{}," * ((7 << 20) // 3) + b"{}]}"  # 7 MiB: under the size limit
    status = server.post_raw("/mutate", body).json()["response"]["status"]
    assert status["code"] == 400 and "more than 1000000 JSON values" in status["message"]


def test_metric_label_values_from_a_review_stay_bounded(server):
    """A 1 MB workload name and owner cost a scrape no more than short ones."""
    huge = "n" * 1_000_000
    pod = make_pod("p").owned_by("Job", huge).opt_in().gpus(1).obj()
    pod["metadata"]["name"] = huge
    job = make_job("j").opt_in().gpus(1).obj()
    job["metadata"]["name"] = huge
    server.record(record_for(job, {"A100-80GB": 10.0, "H100-80GB": 10.0},
                             ("A100-80GB", "H100-80GB")))
    for obj in (job, pod):
        assert server.send(review(obj)).allowed
    scrape = server.health.get("/metrics").text
    assert len(scrape) < 200_000
    assert all(len(line) < 4 * LABEL_CHARS + 200 for line in scrape.splitlines())


def test_the_per_workload_series_are_capped():
    metrics = AdmissionMetrics()
    for index in range(WORKLOAD_SERIES + 500):
        metrics.record_request("ml", f"job-{index}", "Job", "A100-80GB", 1 << 30)
    from prometheus_client import generate_latest

    lines = [line for line in generate_latest(metrics.registry).decode().splitlines()
             if line.startswith("xmem_estimate_request_bytes{")]
    assert len(lines) == WORKLOAD_SERIES
    assert not any('workload="job-0"' in line for line in lines)  # the oldest went first
