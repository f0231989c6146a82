"""xmem-admission: accurate GPU-memory requests for Kubernetes training jobs, estimated on a CPU.

The package splits into two halves that never import each other (see DESIGN): the estimator
bundle (trace format, allocator simulator, GPU catalogue, probe) that runs inside users'
containers with only the standard library and torch, and the cluster side (admission webhook,
integrations, backends, policy, controller).
"""

from __future__ import annotations

from xmem_admission.contract.errors import XmemError

__version__ = "0.1.0"

__all__ = ["XmemError", "__version__"]
