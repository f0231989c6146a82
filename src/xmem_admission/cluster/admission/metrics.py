"""Prometheus metrics of the admission side, in one module (the controller adds its own here).

Each ``AdmissionMetrics`` owns a registry, so several servers can live in one process (tests)
without clashing; ``xmem serve`` exposes its registry on ``/metrics`` of the health port.

Series (all prefixed ``xmem_``):
- ``admission_requests_total{endpoint,kind,operation,decision}``: every review answered;
- ``admission_duration_seconds{endpoint}``: time from body received to response built;
- ``admission_cpu_seconds{endpoint}``: the CPU time of the same (the thread's own: what a
  review costs the replica, whatever else runs on the machine);
- ``workloads_held_total{kind}``: workloads suspended awaiting an estimate (not for dryRun;
  each workload kind starts at 0, so the first hold is an increase Prometheus sees: the alert
  on holds with no controller leading reads it);
- ``admission_certificate_expiry_timestamp_seconds``: when the serving certificate this
  replica serves expires (Unix time), set at each load;
- ``estimates_applied_total{kind,gpu_model,backend}`` and
  ``estimate_request_bytes{namespace,workload,kind,gpu_model}``: the request given to each
  workload (the most recent ``WORKLOAD_SERIES`` workloads, so the series count stays bounded;
  label values from the request are cut to ``LABEL_CHARS`` characters with a digest of the
  whole, so a 1 MB name costs a scrape no more than a short one);
- ``right_sized_requests_total{gpu_model,direction}``: requests of repeat jobs that earlier
  runs' observed peaks ``raised`` or ``lowered`` (``policy.right_sizing``), and
  ``right_sizing_given_back_bytes_total{gpu_model}``: the GPU memory per GPU that lowering took
  off those requests (what the estimate alone would have asked for, minus the request given);
- ``admission_break_glass_total{namespace,kind}``: workloads an admin exempted with the
  ``xmem.io/break-glass`` annotation (``break_glass``: admitted unchanged; not for dryRun);
- ``estimate_cache_requests_total{result}``: estimate store lookups, ``hit`` or ``miss``;
- ``policy_errors_total{reason}``: policies that failed to load or reload, and internal errors.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from xmem_admission.cluster.policy.sizing import Plan

WORKLOAD_SERIES = 5000
HELD_KINDS = ("Job", "JobSet", "PyTorchJob", "TrainJob")  # the kinds the webhook holds
LABEL_CHARS = 253  # a Kubernetes name (DNS subdomain) is at most 253 characters


def label_value(value: str) -> str:
    """A label value of bounded length: the value itself, or its start and a digest of it."""
    if len(value) <= LABEL_CHARS:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:16]
    return f"{value[:LABEL_CHARS - 18]}~{digest}"
# Admission answers take well under a millisecond to a few; the API server gives up at 10 s.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)


class AdmissionMetrics:
    """The admission webhook's metrics and the registry that holds them."""

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "xmem_admission_requests", "Admission reviews answered.",
            ("endpoint", "kind", "operation", "decision"), registry=r,
        )
        self.latency = Histogram(
            "xmem_admission_duration_seconds", "Time to answer an admission review.",
            ("endpoint",), buckets=LATENCY_BUCKETS, registry=r,
        )
        self.cpu = Histogram(
            "xmem_admission_cpu_seconds", "CPU time spent answering an admission review.",
            ("endpoint",), buckets=LATENCY_BUCKETS, registry=r,
        )
        self.held = Counter(
            "xmem_workloads_held", "Workloads held until their GPU memory is estimated.",
            ("kind",), registry=r,
        )
        for kind in HELD_KINDS:
            self.held.labels(kind)
        self.certificate_expiry = Gauge(
            "xmem_admission_certificate_expiry_timestamp_seconds", "When the serving "
            "certificate this replica serves expires (Unix time).", registry=r,
        )
        self.applied = Counter(
            "xmem_estimates_applied", "Recorded estimates turned into GPU memory requests.",
            ("kind", "gpu_model", "backend"), registry=r,
        )
        self.request_bytes = Gauge(
            "xmem_estimate_request_bytes", "GPU memory request per GPU given to a workload.",
            ("namespace", "workload", "kind", "gpu_model"), registry=r,
        )
        self.right_sized = Counter(
            "xmem_right_sized_requests", "Repeat jobs' requests corrected by what earlier runs "
            "used (observed peaks), raised or lowered.", ("gpu_model", "direction"), registry=r,
        )
        self.given_back = Counter(
            "xmem_right_sizing_given_back_bytes", "GPU memory per GPU taken off repeat jobs' "
            "requests because earlier runs used less than estimated (right-sizing).",
            ("gpu_model",), registry=r,
        )
        self.break_glass = Counter(
            "xmem_admission_break_glass", "Workloads an admin admitted unchanged with the "
            "xmem.io/break-glass annotation.", ("namespace", "kind"), registry=r,
        )
        self.cache = Counter(
            "xmem_estimate_cache_requests", "Estimate store lookups by result.",
            ("result",), registry=r,
        )
        self.policy_errors = Counter(
            "xmem_policy_errors", "Policy load failures and internal admission errors.",
            ("reason",), registry=r,
        )
        self._series: OrderedDict[Tuple[str, str, str, str], None] = OrderedDict()
        self._lock = threading.Lock()

    def right_sizing(self, plan: Plan) -> None:
        """Count a plan that right-sizing corrected (no-op for any other)."""
        if plan.uncorrected_request_bytes is None or \
                plan.uncorrected_request_bytes == plan.request_bytes:
            return
        gpu = plan.target.gpu.key
        lowered = plan.request_bytes < plan.uncorrected_request_bytes
        self.right_sized.labels(gpu, "lowered" if lowered else "raised").inc()
        if lowered:
            self.given_back.labels(gpu).inc(plan.given_back_bytes)

    def record_request(self, namespace: str, workload: str, kind: str, gpu: str, value: int) -> None:
        """Set a workload's request gauge, dropping the oldest series beyond WORKLOAD_SERIES."""
        key = (label_value(namespace), label_value(workload), label_value(kind), gpu)
        with self._lock:
            self.request_bytes.labels(*key).set(value)
            self._series.pop(key, None)
            self._series[key] = None
            while len(self._series) > WORKLOAD_SERIES:
                old, _ = self._series.popitem(last=False)
                self.request_bytes.remove(*old)
