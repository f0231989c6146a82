"""The controller: closes the loop between a held workload and its GPU memory estimate.

The webhook holds a workload it has no estimate for (``spec.suspend``, ``xmem.io/held-*``
annotations). The controller (``xmem controller``) then, with all its state in API objects:

- records the estimate of the workload's fingerprint in a ``GPUMemoryEstimate`` (``records``),
  owned by every workload that shares it;
- runs one estimation pod per fingerprint (``podspec``: the workload's image and command on a
  CPU, the probe injected through ``sitecustomize``) and reads its termination message
  (``estimation``);
- writes the sized request into the pod templates and releases the workload, or applies the
  policy's failure action (``workloads``);
- leads through a Lease (``leader``), exports metrics (``metrics``), and backs the webhook's
  estimate store with the recorded estimates (``store``).

Modules: ``kube`` (API facade), ``informer`` (caches and work queue), ``context``,
``estimation``, ``workloads``, ``manager`` (wiring, health), ``leader``, ``records``,
``podspec``, ``store``, ``metrics``. Cluster side: never imports torch or the estimator.
"""
