"""Prometheus metrics of the controller (the admission side's are in ``xmem_admission.cluster.admission.metrics``).

Each ``ControllerMetrics`` owns a registry, like ``AdmissionMetrics``, so several controllers can
live in one process (tests, leader-election replicas) without clashing; ``xmem controller``
serves it on ``/metrics`` of its metrics port.

Series (all prefixed ``xmem_controller_``):
- ``estimations_started_total``, ``estimations_succeeded_total``,
  ``estimations_failed_total{reason}``: estimation pods run, and how they ended
  (``ScriptFailed``, ``OOMKilled``, ``DeadlineExceeded``, ``ImagePullFailed``, ...);
- ``estimation_duration_seconds``: from the estimation pod's creation to its result;
- ``held_workloads{kind}`` and ``held_workload_oldest_age_seconds{kind}``: workloads held now,
  and how long the oldest has waited (an alert fires well before the policy's maxHoldSeconds);
- ``estimations_waiting{namespace}``, ``estimation_oldest_wait_seconds{namespace}`` and
  ``estimations_expected_late{namespace}``: estimations waiting for an estimation pod slot, how
  long the oldest has waited, and how many are expected to end after their workload's
  ``maxHoldSeconds`` (``controller.estimation_line``; a namespace with none waiting has no
  series); ``estimation_pods_refused_total{reason}``: estimation pod creations the API server
  refused (``EstimationQuotaExceeded``: a ResourceQuota; ``EstimationPodRefused``: anything
  else, a LimitRange, a missing service account), each tried again with back-off;
- ``released_workloads_total{kind,outcome}``: ``estimated``, ``default``, ``unchanged``;
- ``estimates{gpu_model}``: recorded estimates that cover each GPU model;
- ``reconcile_errors_total{kind}``: reconciles that failed and were requeued;
- ``leader``: 1 while this replica leads; ``cached_objects{resource}``: objects in its caches;
- ``oom_underestimates_caught_total{source}``: pods of sized workloads that ran out of GPU
  memory, by the message that said so (``pytorch``, ``hami-core``, ``cuda-error``, ...);
  ``oom_retries_total{backend}``: of those, the ones whose workload's next pod was sized bigger;
  ``oom_gave_up_total{backend}``: the ones that ended their workload's retries with a terminal
  reason (``controller.oom_retries``); ``oom_avoided_total{backend}``: workloads
  retried bigger after an OOM that then completed (OOMs avoided on the second try, counted
  when the workload ends, ``controller.observed_peaks``);
- ``observed_peaks_total{source}`` and ``observed_peak_failures_total{reason}``: finished
  workloads' peaks read from Prometheus (``cluster.observations``), and reads that failed
  (right-sizing; what the peaks give back is the webhook's
  ``xmem_right_sizing_given_back_bytes_total``);
- ``learned_overhead_bytes{gpu_model,driver_version}`` and
  ``learned_overhead_jobs{gpu_model,driver_version}``: what each GPU model and driver kept
  outside the allocator in recent finished jobs, as learned
  (``controller.learned_overhead``), and from how many jobs; a figure no longer learned is
  removed.
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Set, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from xmem_admission.cluster.observations import PeakMetrics

# Estimations take from seconds (fake mode, small models) to the policy's deadline (15 min).
DURATION_BUCKETS = (5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0)


class ControllerMetrics:
    """The controller's metrics and the registry that holds them."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.started = Counter("xmem_controller_estimations_started",
                               "Estimation pods created.", registry=r)
        self.succeeded = Counter("xmem_controller_estimations_succeeded",
                                 "Estimations that recorded an estimate.", registry=r)
        self.failed = Counter("xmem_controller_estimations_failed",
                              "Estimations that ended without an estimate, by reason.",
                              ("reason",), registry=r)
        self.duration = Histogram("xmem_controller_estimation_duration_seconds",
                                  "From estimation pod creation to its result.",
                                  buckets=DURATION_BUCKETS, registry=r)
        self.waiting = Gauge("xmem_controller_estimations_waiting",
                             "Estimations waiting for an estimation pod slot, per namespace.",
                             ("namespace",), registry=r)
        self.oldest_wait = Gauge("xmem_controller_estimation_oldest_wait_seconds",
                                 "How long the estimation first in line has waited, per "
                                 "namespace.", ("namespace",), registry=r)
        self.cached = Gauge("xmem_controller_cached_objects", "Objects held in the "
                            "controller's caches, per resource (and label selector).",
                            ("resource",), registry=r)
        self.expected_late = Gauge("xmem_controller_estimations_expected_late",
                                   "Waiting estimations expected to end after their "
                                   "workload's maxHoldSeconds, per namespace.", ("namespace",),
                                   registry=r)
        self.refused = Counter("xmem_controller_estimation_pods_refused",
                               "Estimation pod creations the API server refused, by the Event "
                               "reason (EstimationQuotaExceeded, EstimationPodRefused).",
                               ("reason",), registry=r)
        self.held = Gauge("xmem_controller_held_workloads", "Workloads held by xmem now.",
                          ("kind",), registry=r)
        self.oldest = Gauge("xmem_controller_held_workload_oldest_age_seconds",
                            "How long the longest-held workload has waited.", ("kind",),
                            registry=r)
        self.released = Counter("xmem_controller_released_workloads",
                                "Held workloads released, by outcome.", ("kind", "outcome"),
                                registry=r)
        self.estimates = Gauge("xmem_controller_estimates",
                               "Recorded estimates covering each GPU model.", ("gpu_model",),
                               registry=r)
        self.errors = Counter("xmem_controller_reconcile_errors",
                              "Reconciles that failed and were requeued.", ("kind",), registry=r)
        self.leader = Gauge("xmem_controller_leader", "1 while this replica leads.", registry=r)
        self.leadership_lost = Counter(
            "xmem_controller_leadership_lost",
            "Times this replica could not renew its Lease in time and stood by again.", registry=r)
        self.lease_errors = Counter("xmem_controller_lease_errors",
                                    "Lease reads and writes the API server refused (401, 403).",
                                    ("code",), registry=r)
        self.oom_caught = Counter("xmem_controller_oom_underestimates_caught",
                                  "Pods of sized workloads that ran out of GPU memory, by the "
                                  "message that said so.", ("source",), registry=r)
        self.oom_retries = Counter("xmem_controller_oom_retries",
                                   "Out-of-memory failures after which the workload's next pod "
                                   "was sized bigger.", ("backend",), registry=r)
        self.oom_gave_up = Counter("xmem_controller_oom_gave_up",
                                   "Out-of-memory failures at the largest request a retry may "
                                   "have: the workload's retries ended with a reason.",
                                   ("backend",), registry=r)
        self.oom_avoided = Counter("xmem_controller_oom_avoided",
                                   "Workloads whose pods ran out of GPU memory and that then "
                                   "completed with the larger request of a retry.",
                                   ("backend",), registry=r)
        self.peaks = PeakMetrics(r)
        self.overhead = Gauge(
            "xmem_controller_learned_overhead_bytes",
            "GPU memory outside the caching allocator per process (observed peak minus the "
            "simulated reserved peak), learned from recent finished jobs, per GPU model and "
            "driver.", ("gpu_model", "driver_version"), registry=r)
        self.overhead_jobs = Gauge(
            "xmem_controller_learned_overhead_jobs",
            "Finished jobs the learned figure of a GPU model and driver comes from.",
            ("gpu_model", "driver_version"), registry=r)
        self._gpu_models: Set[str] = set()
        self._overhead_series: Set[Tuple[str, str]] = set()

    def set_held(self, ages_by_kind: Mapping[str, Iterable[float]], kinds: Tuple[str, ...]) -> None:
        """Publish the held workloads: their count and the oldest age, per kind."""
        for kind in kinds:
            ages = list(ages_by_kind.get(kind, ()))
            self.held.labels(kind).set(len(ages))
            self.oldest.labels(kind).set(max(ages) if ages else 0.0)

    def set_line(self, stats: Mapping[str, Tuple[int, float, int]],
                 published: Set[str]) -> Set[str]:
        """Publish the line per namespace: (waiting, oldest wait in seconds, expected late);
        the series of namespaces in ``published`` with none waiting now are removed. Returns
        the namespaces published."""
        for namespace, (count, oldest, late) in stats.items():
            self.waiting.labels(namespace).set(count)
            self.oldest_wait.labels(namespace).set(oldest)
            self.expected_late.labels(namespace).set(late)
        for gone in published - set(stats):
            for gauge in (self.waiting, self.oldest_wait, self.expected_late):
                try:
                    gauge.remove(gone)
                except KeyError:
                    pass
        return set(stats)

    def set_overhead(self, figures: Iterable[Tuple[str, str, int, int]]) -> None:
        """Publish the learned figures: (GPU model, driver, bytes, jobs); others are removed."""
        seen: Set[Tuple[str, str]] = set()
        for gpu, driver, size, jobs in figures:
            self.overhead.labels(gpu, driver).set(size)
            self.overhead_jobs.labels(gpu, driver).set(jobs)
            seen.add((gpu, driver))
        for gone in self._overhead_series - seen:
            self.overhead.remove(*gone)
            self.overhead_jobs.remove(*gone)
        self._overhead_series = seen

    def set_estimates(self, counts: Dict[str, int]) -> None:
        """Publish how many recorded estimates cover each GPU model."""
        for model in self._gpu_models - set(counts):
            self.estimates.labels(model).set(0)
        for model, count in counts.items():
            self.estimates.labels(model).set(count)
        self._gpu_models |= set(counts)
