"""The estimator: standard library and torch only; this package is the probe bundle.

Data flows ``probe`` (run an unmodified training script under a virtual CUDA device and record
every allocation) -> ``trace`` (the allocation stream, the one format between the halves) ->
``orchestrate`` (what a CUDA run does differently from the traced CPU run) -> ``allocator``
(the caching-allocator simulator, for each target GPU) -> ``estimate`` (the public API and the
per-GPU result). ``xmem_admission.bundle`` copies this package, ``contract`` and the package
root into an estimation pod; nothing here may import the cluster side (import-linter checks it).
"""
