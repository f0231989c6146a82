"""Shared test helpers: fluent workload builders, Kubernetes schema validation, a TLS server."""
