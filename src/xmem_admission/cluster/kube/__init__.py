"""Kubernetes plumbing shared by the webhook and the controller.

``client`` (the API with retries and error sorting), ``informer`` (watch-fed caches),
``leader`` (Lease-based leader election), ``kubeconfig`` (credentials), ``quantity`` (exact
resource quantities), ``jsonpatch`` (RFC 6902 patches by diffing), ``resources`` (the forms in
which a pod asks for GPUs).
"""
