"""Backends: how a GPU memory request is expressed for each sharing system (one module each).

``for_name(BackendName)`` returns the backend. Each module's docstring names the upstream
document its resource names and units come from: HAMi's user guide ("Allocate device memory"),
Volcano's "GPU Sharing User guide", Aliyun's gpushare-scheduler-extender user guide, the
KAI-Scheduler GPU sharing docs, and the NVIDIA GPU Operator's "MIG support" with NVIDIA's MIG
user guide; ``DRA`` cites the DRA drivers' ResourceSlice code and ``resource.k8s.io/v1``.

``for_target(target)`` is the backend a policy target writes with: the same as ``for_name``
except for ``DRA``, whose claim follows the target's ``spec.dra`` settings.
"""

from __future__ import annotations

from typing import Dict

from xmem_admission.cluster.backends.annotation import AnnotationBackend
from xmem_admission.cluster.backends.base import Applied, Backend, Existing
from xmem_admission.cluster.backends.dra import DraBackend
from xmem_admission.cluster.backends.gpushare import GpushareBackend
from xmem_admission.cluster.backends.hami import HamiBackend
from xmem_admission.cluster.backends.kai import KaiBackend
from xmem_admission.cluster.backends.mig import MigMixedBackend, MigSingleBackend
from xmem_admission.cluster.backends.volcano import VolcanoBackend
from xmem_admission.cluster.policy.model import BackendName, Target

_ALL: Dict[BackendName, Backend] = {
    b.name: b
    for b in (
        AnnotationBackend(), HamiBackend(), VolcanoBackend(), GpushareBackend(), KaiBackend(),
        MigMixedBackend(), MigSingleBackend(), DraBackend(),
    )
}


def for_name(name: BackendName) -> Backend:
    """The backend for a policy's backend name (every ``BackendName`` has one)."""
    return _ALL[name]


def for_target(target: Target) -> Backend:
    """The backend a policy target writes with (``DRA`` with the target's claim settings)."""
    if target.backend is BackendName.DRA and target.dra is not None:
        return DraBackend(target.dra)
    return _ALL[target.backend]


__all__ = ["Applied", "Backend", "BackendName", "Existing", "for_name", "for_target"]
