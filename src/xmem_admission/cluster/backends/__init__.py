"""Backends: how a GPU memory request is expressed for each sharing system (one module each).

``for_name(BackendName)`` returns the backend; see ``shared/reference/gpu-sharing-and-mig.md``
for the systems and their units.
"""

from __future__ import annotations

from typing import Dict

from xmem_admission.cluster.backends.annotation import AnnotationBackend
from xmem_admission.cluster.backends.base import Applied, Backend, Existing
from xmem_admission.cluster.backends.gpushare import GpushareBackend
from xmem_admission.cluster.backends.hami import HamiBackend
from xmem_admission.cluster.backends.kai import KaiBackend
from xmem_admission.cluster.backends.mig import MigMixedBackend, MigSingleBackend
from xmem_admission.cluster.backends.volcano import VolcanoBackend
from xmem_admission.cluster.policy.model import BackendName

_ALL: Dict[BackendName, Backend] = {
    b.name: b
    for b in (
        AnnotationBackend(), HamiBackend(), VolcanoBackend(), GpushareBackend(), KaiBackend(),
        MigMixedBackend(), MigSingleBackend(),
    )
}


def for_name(name: BackendName) -> Backend:
    """The backend for a policy's backend name (every ``BackendName`` has one)."""
    return _ALL[name]


__all__ = ["Applied", "Backend", "BackendName", "Existing", "for_name"]
