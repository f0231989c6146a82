"""Estimate records for tests, shaped like ``xmem estimate --json`` output plus a fingerprint."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

from xmem_admission.cluster.integrations import fingerprint_of, for_kind
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract import gpus

GiB = 1 << 30


def workload_fingerprint(obj: Mapping[str, Any], gpu_keys: Sequence[str]) -> str:
    """The fingerprint the webhook computes for a workload under a policy's targets."""
    group, _, version = obj["apiVersion"].rpartition("/")
    integration = for_kind(group, version, obj["kind"])
    assert integration is not None
    return fingerprint_of(integration, obj, gpu_keys)


def record_dict(fp: str, totals: Mapping[str, float]) -> Dict[str, Any]:
    """A record whose ``total_bytes`` per GPU model are the given GiB figures."""
    entries = []
    for name, total_gib in totals.items():
        gpu = gpus.lookup(name)
        total = int(total_gib * GiB)
        profile = gpus.smallest_mig_profile(gpu, total)
        entries.append({
            "gpu": gpu.key,
            "capacity_bytes": gpu.capacity_bytes,
            "peak_allocated_bytes": total - 700 * (1 << 20),
            "peak_reserved_bytes": total - 300 * (1 << 20),
            "overhead_bytes": 300 * (1 << 20),
            "total_bytes": total,
            "recommended_request_bytes": int(total * 1.05),
            "fits": total <= gpu.capacity_bytes,
            "mig_profile": profile.name if profile else None,
            "breakdown": {"parameters": total // 4},
        })
    return {"mode": "fake", "steps": 3, "seconds": 4.2, "fingerprint": fp, "gpus": entries}


def record_for(obj: Mapping[str, Any], totals: Mapping[str, float], gpu_keys: Sequence[str]) -> EstimateRecord:
    return EstimateRecord.from_dict(record_dict(workload_fingerprint(obj, gpu_keys), totals))
