"""Cluster credentials for the commands that talk to the API server (serve, controller).

In a pod the service account's in-cluster credentials win; elsewhere the kubeconfig file
(``--kubeconfig``, else ``KUBECONFIG`` / ``~/.kube/config``) is used. Each call returns its own
``ApiClient`` with its own configuration, so nothing depends on the client library's global
default.
"""

from __future__ import annotations

from typing import Any, Optional

from xmem_admission.contract.errors import NoClusterCredentials


def api_client(kubeconfig: Optional[str] = None) -> Any:
    """An official-client ``ApiClient``; raises ``NoClusterCredentials`` saying why not."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    try:
        configuration = client.Configuration()
        # the kubernetes client ships no type annotations
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return client.ApiClient(configuration)
    except ConfigException:
        pass
    try:
        configuration = client.Configuration()
        config.load_kube_config(  # type: ignore[no-untyped-call]  # kubernetes ships no types
            config_file=kubeconfig, client_configuration=configuration)
    except (ConfigException, OSError, TypeError, ValueError) as exc:
        raise NoClusterCredentials(str(exc)) from None
    return client.ApiClient(configuration)
