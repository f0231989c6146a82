"""The cluster side: admission webhook, controller and their plumbing; never imports torch.

In the order a workload's request flows: ``kube`` (API client, informers, leader election,
kubeconfig, quantities, JSON patches, GPU resource forms) -> ``policy`` (the admin's policy and
its sources, fingerprints, the estimate store, sizing) -> ``integrations`` (one module per
workload kind) -> ``backends`` (how each GPU-sharing system expresses a request) ->
``admission`` (the webhook and its server) and ``controller`` (estimation pods, records,
release). It reads ``xmem_admission.contract`` and never the estimator (import-linter checks it).
"""
