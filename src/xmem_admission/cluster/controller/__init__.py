"""The controller: closes the loop between a held workload and its GPU memory estimate.

The webhook holds a workload it has no estimate for (``spec.suspend``, ``xmem.io/held-*``
annotations). The controller (``xmem controller``) then, with all its state in API objects:

- records the estimate of the workload's fingerprint in a ``GPUMemoryEstimate`` (``records``),
  owned by every workload that shares it;
- runs one estimation pod per fingerprint (``podspec``: the workload's image and command on a
  CPU, the probe injected through ``sitecustomize``) and reads its termination message
  (``estimation_pods``);
- writes the sized request into the pod templates and releases the workload, or applies the
  policy's failure action (``workloads``);
- leads through a Lease (``kube.leader``), exports metrics (``metrics``), and backs the webhook's
  estimate store with the recorded estimates (``gme_store``).

Modules: ``context``, ``estimation_pods``, ``workloads``, ``manager`` (wiring, health),
``records``, ``podspec``, ``gme_store``, ``metrics``; the API facade, caches, work queue and
leader election are in ``xmem_admission.cluster.kube``, the workload kinds it releases in
``xmem_admission.cluster.integrations`` (those that can be held). Cluster side: never imports
torch or the estimator.
"""
