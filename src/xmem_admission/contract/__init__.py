"""The contract both sides read: standard library only, no torch, no Kubernetes client.

- ``gpus``: the catalogue of GPU models (capacity, overhead outside the allocator, cuBLAS
  workspaces, MIG profiles), every figure with its source.
- ``termination``: the estimation pod's result, as the probe writes it into the termination
  message and the controller reads it back.
- ``probe_env``: the environment variables through which the estimation pod configures the
  probe bundle.
- ``errors``: every exception the package raises, with the CLI exit code it maps to.

It is copied into users' images with the estimator (``xmem_admission.bundle``), and the cluster
side imports it without importing torch; import-linter keeps it free of both sides.
"""
