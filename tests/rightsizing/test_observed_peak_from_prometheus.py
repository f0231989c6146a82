"""A finished workload's observed GPU memory peak, read from a real Prometheus.

Prometheus (``make tools``) scrapes an exporter this test serves every second, with DCGM
exporter- and HAMi-shaped series (``cluster.observations`` cites their names and labels). Each
pod's peak is in one scrape only, so the latest value (what an instant query returns) is lower:
only a maximum over the pod's lifetime finds it. Prometheus stopped, or too slow to answer,
gives no figure, a warning and a metric, never an exception.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, Tuple

import pytest
import trustme
from prometheus_client import CollectorRegistry

from tests.rightsizing.prometheus import Exporter, reply, start_prometheus, stop, wait_for
from xmem_admission.cluster.observations import (
    TENANT_HEADER,
    PeakReader,
    PodLifetime,
    PrometheusSource,
    Source,
)

MiB, GiB = 1 << 20, 1 << 30
SPIKE_AT = {"train-a": 3, "mig-a": 4, "notebook": 5, "notebook-v29": 3, "notebook-both": 6}  # the one scrape each peak is in
SCRAPES = 9  # scrapes to wait for: every spike, and a few lower values after it
FAILURES = "xmem_controller_observed_peak_failures_total"
A, B, C, D = (f"GPU-5fd4e2a4-1c0b-7b52-2f0a-3e61c0d2a9{n}" for n in ("0a", "0b", "0c", "0d"))
DCGM_LABELS = 'gpu="{gpu}",UUID="{uuid}",pci_bus_id="00000000:07:00.0",device="nvidia{gpu}",' \
              'modelName="NVIDIA A100-SXM4-80GB",Hostname="gpu-node-1",' \
              'DCGM_FI_DRIVER_VERSION="580.159.04"'


def exposition(n: int) -> str:
    """The exporter's answer to scrape ``n`` (0, 1, ...)."""
    def dcgm(gpu: int, uuid: str, mib: int, pod: str = "", mig: str = "") -> str:
        labels = DCGM_LABELS.format(gpu=gpu, uuid=uuid) + mig
        if pod:
            labels += f',container="trainer",namespace="ml",pod="{pod}"'
        return f"DCGM_FI_DEV_FB_USED{{{labels}}} {mib}"

    shared_pod = "shared-1" if n % 2 == 0 else "shared-2"  # time-sliced: the mapping alternates
    lines = [
        "# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).",
        "# TYPE DCGM_FI_DEV_FB_USED gauge",
        dcgm(0, A, 7000 if n == SPIKE_AT["train-a"] else 1000, "train-a"),
        dcgm(1, B, 8000 if n == 3 else 3000, shared_pod),
        dcgm(2, C, 2500 if n == SPIKE_AT["mig-a"] else 500, "mig-a",
             ',GPU_I_PROFILE="1g.10gb",GPU_I_ID="2"'),
        dcgm(2, C, 9000, "other-b", ',GPU_I_PROFILE="3g.40gb",GPU_I_ID="1"'),
        dcgm(3, D, 30000, "notebook"),  # the whole card HAMi shares: not the container's figure
        "# HELP vGPU_device_memory_usage_in_bytes vGPU device usage",
        "# TYPE vGPU_device_memory_usage_in_bytes gauge",
        'vGPU_device_memory_usage_in_bytes{podnamespace="ml",podname="notebook",ctrname="jupyter",'
        f'vdeviceid="0",deviceuuid="{D}"}} '
        f'{6 * GiB if n == SPIKE_AT["notebook"] else 2 * GiB}',
        # HAMi v2.9.0 on: the new name; the old one too only with --legacy-metrics (notebook-both)
        "# HELP hami_vgpu_memory_used_bytes vGPU device memory usage in bytes",
        "# TYPE hami_vgpu_memory_used_bytes gauge",
        'hami_vgpu_memory_used_bytes{namespace="ml",pod="notebook-v29",container="jupyter",'
        f'vdevice_index="0",device_uuid="{D}"}} '
        f'{5 * GiB if n == SPIKE_AT["notebook-v29"] else 1 * GiB}',
        'hami_vgpu_memory_used_bytes{namespace="ml",pod="notebook-both",container="jupyter",'
        f'vdevice_index="0",device_uuid="{D}"}} '
        f'{3 * GiB if n == SPIKE_AT["notebook-both"] else 1 * GiB}',
        'vGPU_device_memory_usage_in_bytes{podnamespace="ml",podname="notebook-both",'
        f'ctrname="jupyter",vdeviceid="0",deviceuuid="{D}"}} '
        f'{3 * GiB if n == SPIKE_AT["notebook-both"] else 1 * GiB}',
        "# HELP vGPU_device_memory_limit_in_bytes vGPU device limit",
        "# TYPE vGPU_device_memory_limit_in_bytes gauge",
        'vGPU_device_memory_limit_in_bytes{podnamespace="ml",podname="notebook",ctrname="jupyter",'
        f'vdeviceid="0",deviceuuid="{D}"}} {8 * GiB}',
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    exporter = Exporter(exposition).start()
    began = time.time() - 1
    process, url = start_prometheus(tmp_path_factory.mktemp("prometheus"), exporter)
    reader = PeakReader(PrometheusSource(url, timeout_seconds=10))
    query = 'count_over_time(DCGM_FI_DEV_FB_USED{pod="train-a"}[10m])'
    wait_for(lambda: len(exporter.served) > SCRAPES and any(
        float(s["value"][1]) > SCRAPES
        for s in reader.query(query, time.time(), time.monotonic() + 5)),
        f"{SCRAPES} scrapes in Prometheus", process)
    try:
        yield {"url": url, "process": process, "exporter": exporter, "began": began,
               "ended": time.time()}
    finally:
        stop(process)
        exporter.shutdown()


def pod(scraped: Dict[str, Any], name: str, started: float = 0.0) -> PodLifetime:
    return PodLifetime("ml", name, started or float(scraped["began"]), float(scraped["ended"]))


def reader_for(scraped: Dict[str, Any], **options: Any) -> Tuple[PeakReader,
                                                                      CollectorRegistry]:
    registry = CollectorRegistry()
    source = PrometheusSource(str(scraped["url"]), **options)
    return PeakReader(source, registry), registry


def test_the_peak_of_a_pod_alone_on_its_gpu_is_the_spike_an_instant_query_misses(scraped):
    reader, registry = reader_for(scraped)

    peak = reader.read([pod(scraped, "train-a")])
    instant = reader.query('DCGM_FI_DEV_FB_USED{pod="train-a"}', float(scraped["ended"]),
                           time.monotonic() + 5)

    assert [float(s["value"][1]) for s in instant] == [1000.0]  # the latest value: no spike
    assert peak is not None and peak.source is Source.DCGM
    assert peak.peak_bytes == 7000 * MiB and peak.series == 1
    assert peak.driver_version == "580.159.04"  # dcgm-exporter's label on every series
    assert registry.get_sample_value("xmem_controller_observed_peaks_total",
                                     {"source": "dcgm"}) == 1


def test_the_window_is_the_pods_lifetime(scraped):
    served = scraped["exporter"].served
    after_spike = served[SPIKE_AT["train-a"] + 1] + 0.1  # the spike's scrape came before

    peak = reader_for(scraped)[0].read([pod(scraped, "train-a", started=after_spike)])

    assert peak is not None and peak.peak_bytes == 1000 * MiB


def test_a_mig_slice_counts_its_own_series_not_its_neighbours(scraped):
    peak = reader_for(scraped)[0].read([pod(scraped, "mig-a")])

    assert peak is not None and peak.source is Source.DCGM
    assert peak.peak_bytes == 2500 * MiB and peak.shared_devices_skipped == 0


def test_a_device_other_pods_were_seen_on_gives_no_figure(scraped):
    reader, registry = reader_for(scraped)

    assert reader.read([pod(scraped, "shared-1")]) is None
    assert registry.get_sample_value("xmem_controller_observed_peaks_total",
                                     {"source": "none"}) == 1
    assert registry.get_sample_value(FAILURES, {"reason": "unreachable"}) == 0


def test_hamis_per_container_series_come_before_the_shared_cards_dcgm_figure(scraped):
    peak = reader_for(scraped)[0].read([pod(scraped, "notebook")])

    assert peak is not None and peak.source is Source.HAMI
    assert peak.peak_bytes == 6 * GiB and peak.series == 1
    assert peak.driver_version == "580.159.04"  # from DCGM's series of the same device


def test_hamis_series_under_its_new_name_from_v2_9_is_read_as_well(scraped):
    peak = reader_for(scraped)[0].read([pod(scraped, "notebook-v29")])

    assert peak is not None and peak.source is Source.HAMI
    assert peak.peak_bytes == 5 * GiB and peak.series == 1
    assert peak.driver_version == "580.159.04"


def test_a_container_hami_exports_under_both_names_counts_once(scraped):
    peak = reader_for(scraped)[0].read([pod(scraped, "notebook-both")])

    assert peak is not None and peak.source is Source.HAMI
    assert peak.peak_bytes == 3 * GiB and peak.series == 1  # one container x device, not two


def test_a_workloads_peak_is_the_largest_of_its_pods(scraped):
    peak = reader_for(scraped)[0].read([pod(scraped, "mig-a"), pod(scraped, "train-a")])

    assert peak is not None and peak.peak_bytes == 7000 * MiB and peak.series == 2


class _Gateway(BaseHTTPRequestHandler):
    """An HTTPS gateway in front of Prometheus that wants a bearer token and a tenant, as a
    multi-tenant query frontend (or an authenticating proxy) does."""

    upstream = ""
    token = "s3cret-token"
    tenant = "team-ml"

    def do_GET(self) -> None:  # noqa: N802
        if (self.headers.get("Authorization") != f"Bearer {self.token}"
                or self.headers.get(TENANT_HEADER) != self.tenant):
            self.send_response(401)
            self.end_headers()
            return
        with urllib.request.urlopen(self.upstream + self.path, timeout=10) as answer:
            reply(self, answer.read(), "application/json")

    def log_message(self, *args: object) -> None:
        pass


def test_a_bearer_token_ca_bundle_and_tenant_reach_a_gateway_that_wants_them(scraped, tmp_path,
                                                                             caplog):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "token").write_text(_Gateway.token + "\n")
    handler = type("Gateway", (_Gateway,), {"upstream": str(scraped["url"])})
    gateway = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(tls)
    gateway.socket = tls.wrap_socket(gateway.socket, server_side=True)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{gateway.server_port}"
    try:
        with_all, _ = reader_for({"url": url}, ca_file=str(tmp_path / "ca.pem"),
                                 bearer_token_file=str(tmp_path / "token"), tenant="team-ml")
        no_tenant, registry = reader_for({"url": url}, ca_file=str(tmp_path / "ca.pem"),
                                         bearer_token=_Gateway.token)
        peak = with_all.read([pod(scraped, "train-a")])
        with caplog.at_level(logging.WARNING, logger="xmem_admission.cluster.observations"):
            refused = no_tenant.read([pod(scraped, "train-a")])
    finally:
        gateway.shutdown()

    assert peak is not None and peak.peak_bytes == 7000 * MiB
    assert refused is None
    assert registry.get_sample_value(FAILURES, {"reason": "http"}) == 1
    assert "HTTP 401" in caplog.text and "ml/train-a" in caplog.text


def test_prometheus_too_slow_to_answer_gives_a_warning_and_a_metric_and_nothing_else(
        scraped, caplog):
    process = scraped["process"]
    reader, registry = reader_for(scraped, timeout_seconds=1.5)
    os.kill(process.pid, signal.SIGSTOP)  # it accepts connections and never answers
    try:
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="xmem_admission.cluster.observations"):
            peak = reader.read([pod(scraped, "train-a")])
        took = time.monotonic() - began
    finally:
        os.kill(process.pid, signal.SIGCONT)

    assert peak is None and took < 4
    assert registry.get_sample_value(FAILURES, {"reason": "timeout"}) == 1
    assert registry.get_sample_value(FAILURES, {"reason": "unreachable"}) == 0
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "timeout" in caplog.text


def test_prometheus_stopped_gives_a_warning_and_a_metric_and_nothing_else(tmp_path, caplog):
    exporter = Exporter(exposition).start()
    process, url = start_prometheus(tmp_path / "prometheus", exporter)
    reader, registry = reader_for({"url": url}, timeout_seconds=5)
    now = time.time()
    reader.read([PodLifetime("ml", "train-a", now - 5, now)])
    assert registry.get_sample_value(FAILURES, {"reason": "unreachable"}) == 0  # it answered
    stop(process)
    exporter.shutdown()

    with caplog.at_level(logging.WARNING, logger="xmem_admission.cluster.observations"):
        peak = reader.read([PodLifetime("ml", "train-a", now - 5, now)])

    assert peak is None
    assert registry.get_sample_value(FAILURES, {"reason": "unreachable"}) == 1
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert url in caplog.text
