"""Backends: how a GPU memory request is expressed for each sharing system (one module each).

``for_name(BackendName)`` returns the backend; see ``shared/reference/gpu-sharing-and-mig.md``
for the systems and their units.
"""

from __future__ import annotations

from typing import Dict

from xmem_admission.backends.annotation import AnnotationBackend
from xmem_admission.backends.base import Applied, Backend, Existing
from xmem_admission.backends.gpushare import GpushareBackend
from xmem_admission.backends.hami import HamiBackend
from xmem_admission.backends.kai import KaiBackend
from xmem_admission.backends.mig import MigMixedBackend, MigSingleBackend
from xmem_admission.backends.volcano import VolcanoBackend
from xmem_admission.policy import BackendName

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
