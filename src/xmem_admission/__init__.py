"""xmem-admission: accurate GPU-memory requests for Kubernetes training jobs, estimated on a CPU.

Three packages, two walls (``docs/architecture.md``): ``contract`` (standard library only, read
by both sides), ``estimator`` (standard library and torch: the probe bundle copied into users'
containers) and ``cluster`` (admission webhook, controller and their plumbing, never torch);
``commands`` and ``cli`` sit on top. import-linter keeps the walls.
"""

from __future__ import annotations

from xmem_admission.contract.errors import XmemError

__version__ = "0.1.0"

__all__ = ["XmemError", "__version__"]
