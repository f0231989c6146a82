"""The real control plane's per-test fixtures (a namespace, its policy, the webhook and the
controller as processes; the GPU process node), shared with tests/e2e_real."""

from tests.e2e_real.conftest import gpu_process_node, xmem  # noqa: F401 (pytest fixtures)
