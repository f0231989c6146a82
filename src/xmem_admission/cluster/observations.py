"""What a finished workload's pods really used on their GPUs, read from Prometheus.

Right-sizing corrects a repeat job's estimate by the peaks earlier runs used
(``policy.right_sizing``). This module asks Prometheus's HTTP API (``GET /api/v1/query``) for
that peak: the maximum over each pod's lifetime (``max_over_time`` over a range ending when the
pod ended), never an instant value, which misses a peak that lasted less than a scrape interval's
worth of the series. Two sources, in this order:

1. HAMi's per-container series, exact on shared GPUs, under either of its names (the value is
   the container's device memory as HAMi-core accounts it: context, modules and buffers):
   ``hami_vgpu_memory_used_bytes`` (labels ``namespace``, ``pod``, ``container``,
   ``vdevice_index``, ``device_uuid``), the name HAMi's vGPU monitor exports from v2.9.0 on, and
   ``vGPU_device_memory_usage_in_bytes`` (``podnamespace``, ``podname``, ``ctrname``,
   ``vdeviceid``, ``deviceuuid``), the only name up to v2.8.3 and, from v2.9.0, exported beside the
   new one only with ``--legacy-metrics`` (the HAMi chart's ``legacyMetrics``, false by default)
   (Project-HAMi/HAMi ``cmd/vGPUmonitor/metrics.go``: ``ctrvGPUdesc`` at v2.4.0 through v2.8.3;
   ``ctrvGPUdesc`` and ``legacyCtrvGPUdesc`` at v2.9.0, 3a006c6ae2f077a2683df7805c43656c07f6dc15,
   and v2.10.0, 4707fb02c91c545bc7343ce26dba4c32919f9a3e; ``cmd/vGPUmonitor/main.go``
   ``--legacy-metrics``). Both are read; a container's device seen under both names counts once
   (its larger figure), so a monitor exporting both is not double counted.
2. DCGM exporter's ``DCGM_FI_DEV_FB_USED`` (MiB, "Framebuffer memory used (in MiB)", the
   exporter's default counters), one series per device or MIG slice (``UUID``, and ``GPU_I_ID``
   on a slice), with the pod it is assigned to as ``namespace``, ``pod`` and ``container``
   (NVIDIA/dcgm-exporter ``pkg/dcgmexporter/types.go`` at
   5a052c34cc75a37a775f485e95654fcd4d2c97c5: ``podAttribute``, ``namespaceAttribute``,
   ``containerAttribute``). The figure is the whole device's (or slice's), so it counts only for
   a device or slice that no other pod was seen on during the pod's lifetime (a second query
   counts the pods on each).

A workload's figure is per GPU: the largest over its pods, containers and devices. Prometheus
down, slow (``timeout_seconds`` covers all the queries of one read), refusing the credentials or
answering nonsense yields no figure, a logged warning and ``xmem_controller_observed_peak_
failures_total{reason}``, never an exception to the caller. A bearer token (or a token file,
read at each read so a projected service-account token may rotate), a CA bundle for HTTPS and a
tenant (``X-Scope-OrgID``, the header Cortex, Mimir, Thanos and Loki read a tenant from) are
supported.
"""

from __future__ import annotations

import enum
import http.client
import json
import logging
import math
import re
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from prometheus_client import CollectorRegistry, Counter

from xmem_admission.contract.errors import PrometheusQueryError

log = logging.getLogger(__name__)

HAMI_USAGE = "hami_vgpu_memory_used_bytes"  # bytes (HAMi >= v2.9.0 cmd/vGPUmonitor/metrics.go)
HAMI_LEGACY_USAGE = "vGPU_device_memory_usage_in_bytes"  # bytes (HAMi <= v2.8.3; later with
# --legacy-metrics; cmd/vGPUmonitor/metrics.go)
# Each HAMi name's labels: (namespace, pod, container, virtual device, device UUID).
HAMI_SERIES: Tuple[Tuple[str, Tuple[str, str, str, str, str]], ...] = (
    (HAMI_USAGE, ("namespace", "pod", "container", "vdevice_index", "device_uuid")),
    (HAMI_LEGACY_USAGE, ("podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid")),
)
DCGM_FB_USED = "DCGM_FI_DEV_FB_USED"  # MiB (dcgm-exporter default counters)
DCGM_DRIVER = "DCGM_FI_DRIVER_VERSION"  # a label on every series (dcgm-exporter 3.x, 4.x)
MIB = 1 << 20
TENANT_HEADER = "X-Scope-OrgID"


class Source(str, enum.Enum):
    """Where an observed peak came from."""

    HAMI = "HAMi"  # the GME's runs[].source
    DCGM = "DCGM"

    @property
    def label(self) -> str:
        """The metric's ``source`` label: ``hami``, ``dcgm``."""
        return self.name.lower()


class Failure(str, enum.Enum):
    """Why a read gave no figure (the metric's ``reason`` label)."""

    UNREACHABLE = "unreachable"  # connection refused, reset, DNS, TLS
    TIMEOUT = "timeout"  # no whole answer within timeout_seconds
    HTTP = "http"  # an HTTP error status (401 without the right token, 5xx)
    RESPONSE = "response"  # not Prometheus's JSON, or status "error"


@dataclass(frozen=True)
class PrometheusSource:
    """How to reach the Prometheus (or a compatible query API) that scrapes the GPU exporters."""

    url: str  # the API's base, e.g. https://prometheus.monitoring:9090 (".../api/v1" is added)
    bearer_token: Optional[str] = None
    bearer_token_file: Optional[str] = None  # read at each read, so a rotated token is used
    ca_file: Optional[str] = None  # the CA bundle for an https URL (the system's when None)
    tenant: Optional[str] = None  # sent as X-Scope-OrgID
    timeout_seconds: float = 10.0  # for all the queries of one read together
    slack_seconds: float = 0.0  # widens each pod's window on both sides (clock skew, last scrape)

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"prometheus url must be http(s)://host[:port][/path], got "
                             f"{self.url!r}")
        if self.timeout_seconds <= 0 or self.slack_seconds < 0:
            raise ValueError("timeout_seconds must be positive and slack_seconds not negative")
        if self.bearer_token and self.bearer_token_file:
            raise ValueError("give bearer_token or bearer_token_file, not both")


@dataclass(frozen=True)
class PodLifetime:
    """One pod of a finished workload, and when it ran (Unix seconds)."""

    namespace: str
    name: str
    started: float
    finished: float


@dataclass(frozen=True)
class ObservedPeak:
    """The most GPU memory one GPU of a workload held, over its pods' lifetimes."""

    peak_bytes: int
    source: Source
    series: int  # the containers x devices (HAMi) or devices (DCGM) it is the maximum of
    shared_devices_skipped: int = 0  # DCGM devices left out: another pod was seen on them
    driver_version: Optional[str] = None  # DCGM's DCGM_FI_DRIVER_VERSION label, when one


def _label_value(value: str) -> str:
    """A PromQL string literal's content (double-quoted: backslash and quote escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _window(pod: PodLifetime, slack: float) -> Tuple[float, str]:
    """(evaluation time, range) covering the pod's lifetime."""
    end = pod.finished + slack
    seconds = max(1, math.ceil(end - (pod.started - slack)))
    return end, f"{seconds}s"


class PeakMetrics:
    """The reads' counters: one set per registry, shared by every reader a controller builds
    (a policy that changes its Prometheus gets a new reader, not new series)."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.failures = Counter(
            "xmem_controller_observed_peak_failures",
            "Reads of a finished workload's observed GPU memory peak from Prometheus that gave "
            "no figure, by reason (unreachable, timeout, http, response).",
            ["reason"], registry=registry)
        self.peaks = Counter(
            "xmem_controller_observed_peaks",
            "Observed GPU memory peaks read from Prometheus, by source (hami, dcgm, none: no "
            "series for the pods).", ["source"], registry=registry)
        for reason in Failure:
            self.failures.labels(reason.value)


class PeakReader:
    """Reads observed peaks from one Prometheus; ``read`` never raises."""

    def __init__(self, source: PrometheusSource, registry: Optional[CollectorRegistry] = None,
                 clock: Callable[[], float] = time.monotonic,
                 metrics: Optional[PeakMetrics] = None) -> None:
        self.source = source
        self._clock = clock
        metrics = metrics if metrics is not None else PeakMetrics(registry)
        self.failures, self.peaks = metrics.failures, metrics.peaks
        self._tls: Optional[ssl.SSLContext] = None
        self._tls_error = ""
        try:
            self._tls = ssl.create_default_context(cafile=source.ca_file)
        except (OSError, ssl.SSLError) as exc:  # a CA file missing or unreadable: each read
            self._tls_error = f"cannot use the CA bundle {source.ca_file}: {exc}"  # says so

    # -- the HTTP API -------------------------------------------------------------------
    def _headers(self) -> Dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self.source.bearer_token
        if self.source.bearer_token_file:
            try:
                with open(self.source.bearer_token_file, encoding="utf-8") as fh:
                    token = fh.read().strip()
            except OSError as exc:
                raise PrometheusQueryError(
                    Failure.UNREACHABLE.value,
                    f"cannot read the bearer token file {self.source.bearer_token_file}: "
                    f"{exc.strerror}") from None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if self.source.tenant:
            headers[TENANT_HEADER] = self.source.tenant
        return headers

    def query(self, promql: str, at: float, deadline: float) -> List[Dict[str, Any]]:
        """An instant query's vector (``data.result``), evaluated at ``at`` (Unix seconds)."""
        left = deadline - self._clock()
        if left <= 0:
            raise PrometheusQueryError(Failure.TIMEOUT.value,
                                       f"no time left of {self.source.timeout_seconds:g} s")
        params = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}",
                                         "timeout": f"{max(left, 0.001):.3f}"})
        url = f"{self.source.url.rstrip('/')}/api/v1/query?{params}"
        request = urllib.request.Request(url, headers=self._headers(), method="GET")
        context = self._tls if url.startswith("https:") else None
        if url.startswith("https:") and context is None:
            raise PrometheusQueryError(Failure.UNREACHABLE.value, self._tls_error)
        try:
            with urllib.request.urlopen(request, timeout=left, context=context) as answer:
                body = answer.read()
        except urllib.error.HTTPError as exc:
            said = _error_text(exc)
            raise PrometheusQueryError(Failure.HTTP.value, f"HTTP {exc.code} {exc.reason}"
                                       + (f": {said}" if said else "")) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (socket.timeout, TimeoutError)):
                raise PrometheusQueryError(Failure.TIMEOUT.value,
                                           f"no answer within {left:.1f} s") from None
            raise PrometheusQueryError(Failure.UNREACHABLE.value, str(exc.reason)) from None
        except (socket.timeout, TimeoutError):
            raise PrometheusQueryError(Failure.TIMEOUT.value,
                                       f"no whole answer within {left:.1f} s") from None
        except (http.client.HTTPException, OSError) as exc:
            raise PrometheusQueryError(Failure.UNREACHABLE.value,
                                       f"{type(exc).__name__}: {exc}") from None
        if self._clock() > deadline:
            raise PrometheusQueryError(Failure.TIMEOUT.value,
                                       f"answered after {self.source.timeout_seconds:g} s")
        return _vector(body)

    # -- the peak -----------------------------------------------------------------------
    def read(self, pods: Sequence[PodLifetime]) -> Optional[ObservedPeak]:
        """The workload's peak per GPU over its pods' lifetimes; None when Prometheus has no
        series for them, or failed (then a warning is logged and the failure counted)."""
        return self.observe(pods)[0]

    def observe(self, pods: Sequence[PodLifetime]) -> Tuple[Optional[ObservedPeak],
                                                              Optional[Failure]]:
        """``read``, and why there is no figure when Prometheus failed (None when it answered,
        with or without series for the pods)."""
        deadline = self._clock() + self.source.timeout_seconds
        try:
            found = self._hami(pods, deadline) or self._dcgm(pods, deadline)
        except PrometheusQueryError as exc:
            self.failures.labels(exc.reason).inc()
            names = ", ".join(f"{p.namespace}/{p.name}" for p in pods)
            log.warning("no observed GPU memory peak for %s: Prometheus at %s: %s (%s)", names,
                        self.source.url, exc, exc.reason)
            return None, Failure(exc.reason)
        self.peaks.labels(found.source.label if found else "none").inc()
        return found, None

    def _hami(self, pods: Sequence[PodLifetime], deadline: float) -> Optional[ObservedPeak]:
        # (pod, container, virtual device, device UUID) -> its peak, under either series name
        peaks: Dict[Tuple[str, str, str, str, str], float] = {}
        drivers: Set[str] = set()
        for pod in pods:
            at, span = _window(pod, self.source.slack_seconds)
            uuids: Set[str] = set()
            for metric, labels in HAMI_SERIES:
                ns_label, pod_label, ctr_label, vdev_label, uuid_label = labels
                selector = (f'{metric}{{{ns_label}="{_label_value(pod.namespace)}",'
                            f'{pod_label}="{_label_value(pod.name)}"}}')
                promql = (f"max by ({', '.join(labels)}) "
                          f"(max_over_time({selector}[{span}]))")
                for series in self.query(promql, at, deadline):
                    tags = series["metric"]
                    key = (pod.namespace, pod.name, str(tags.get(ctr_label, "")),
                           str(tags.get(vdev_label, "")), str(tags.get(uuid_label, "")))
                    peaks[key] = max(peaks.get(key, 0.0), _number(series))
                    uuids.add(key[4])
            uuids.discard("")
            if uuids:  # HAMi's series name no driver; DCGM's series of the same device do
                devices = _label_value("|".join(re.escape(u) for u in sorted(uuids)))
                drivers |= {str(s["metric"].get(DCGM_DRIVER) or "")[:64] for s in self.query(
                    f'max by ({DCGM_DRIVER}) (max_over_time({DCGM_FB_USED}{{UUID=~"{devices}"}}'
                    f"[{span}]))", at, deadline)}
        if not peaks:
            return None
        return ObservedPeak(int(max(peaks.values())), Source.HAMI, len(peaks),
                            driver_version=_one(drivers))

    def _dcgm(self, pods: Sequence[PodLifetime], deadline: float) -> Optional[ObservedPeak]:
        values: List[float] = []
        drivers: Set[str] = set()
        skipped = 0
        for pod in pods:
            at, span = _window(pod, self.source.slack_seconds)
            selector = (f'{DCGM_FB_USED}{{namespace="{_label_value(pod.namespace)}",'
                        f'pod="{_label_value(pod.name)}"}}')
            own = self.query(f"max by (UUID, GPU_I_ID, {DCGM_DRIVER}) "
                             f"(max_over_time({selector}[{span}]))", at, deadline)
            if not own:
                continue
            uuids = sorted({s["metric"].get("UUID", "") for s in own} - {""})
            # every pod seen on those devices or slices during the lifetime
            devices = _label_value("|".join(re.escape(u) for u in uuids))
            on_devices = f'{DCGM_FB_USED}{{UUID=~"{devices}",pod!=""}}'
            seen = self.query(f"count by (UUID, GPU_I_ID) (max by (UUID, GPU_I_ID, namespace, "
                              f"pod) (max_over_time({on_devices}[{span}])))", at, deadline)
            pods_on = {_device(s["metric"]): _number(s) for s in seen}
            for series in own:
                if pods_on.get(_device(series["metric"]), 1) > 1:
                    skipped += 1
                else:
                    values.append(_number(series) * MIB)
                    drivers.add(str(series["metric"].get(DCGM_DRIVER) or "")[:64])
        if not values:
            if skipped:
                log.info("observed peak: DCGM devices of %s were shared with other pods (%d); "
                         "no figure", ", ".join(p.name for p in pods), skipped)
            return None
        return ObservedPeak(int(max(values)), Source.DCGM, len(values), skipped, _one(drivers))


def _one(drivers: Set[str]) -> Optional[str]:
    """The driver version of a workload's devices: the one every series named, else None
    (none named, or devices under two drivers)."""
    named = drivers - {""}
    return named.pop() if len(named) == 1 and len(drivers) == 1 else None


def _error_text(exc: urllib.error.HTTPError) -> str:
    """Prometheus's ``error`` field of an error answer, when it has one."""
    try:
        answer = json.loads(exc.read(4096))
    except (OSError, ValueError):
        return ""
    return str(answer.get("error", ""))[:200] if isinstance(answer, dict) else ""


def _device(labels: Dict[str, str]) -> Tuple[str, str]:
    return labels.get("UUID", ""), labels.get("GPU_I_ID", "")


def _number(sample: Dict[str, Any]) -> float:
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        raise PrometheusQueryError(Failure.RESPONSE.value,
                                   f"a sample without a number: {str(sample)[:200]}") from None
    if not math.isfinite(value) or value < 0:
        raise PrometheusQueryError(Failure.RESPONSE.value, f"a sample of {value}")
    return value


def _vector(body: bytes) -> List[Dict[str, Any]]:
    """``data.result`` of an instant query's answer (resultType vector)."""
    try:
        answer = json.loads(body)
    except ValueError:
        raise PrometheusQueryError(Failure.RESPONSE.value,
                                   f"not JSON: {body[:200]!r}") from None
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else None
        raise PrometheusQueryError(Failure.RESPONSE.value, f"query failed: {error or answer!r}"[:300])
    data = answer.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(
            data.get("result"), list):
        raise PrometheusQueryError(Failure.RESPONSE.value, f"not a vector: {str(data)[:200]}")
    return [s for s in data["result"] if isinstance(s, dict) and isinstance(s.get("metric"), dict)]


__all__ = ["DCGM_DRIVER", "DCGM_FB_USED", "Failure", "HAMI_LEGACY_USAGE", "HAMI_SERIES", "HAMI_USAGE",
           "ObservedPeak", "PeakMetrics", "PeakReader", "PodLifetime", "PrometheusSource", "Source",
           "TENANT_HEADER"]
