"""The real JobSet controller (sigs.k8s.io/jobset, the release in scripts/trainer-versions.env,
built with Kubeflow Trainer by scripts/build-trainer.sh: ``make tools``) as a host process beside
the real control plane.

``JobSet(cluster).start()``:

- applies JobSet's CRD (``jobsets.jobset.x-k8s.io``, from the build's cache entry) and waits for
  it;
- runs ``jobset`` as the service account its release manifests give it
  (``jobset-system/jobset-controller-manager``), bound to ``cluster-admin`` here;
- with a configuration file (config.jobset.x-k8s.io/v1alpha1, the release's
  config/components/manager/controller_manager_config.yaml adapted to a host process): internal
  certificate management off, the webhook server on 127.0.0.1 with a serving certificate from the
  test CA in ``webhook.certDir``, metrics off, health on a loopback port, no leader election;
- applies JobSet's webhook configurations as its release does (the module's
  config/components/webhook/manifests.yaml with the release's kustomize patches, which limit the
  pod webhooks to pods labelled ``jobset.sigs.k8s.io/jobset-name``, and the release's ``jobset-``
  name prefix), every ``clientConfig`` turned into ``url: https://127.0.0.1:PORT/...``.

JobSets then make their Jobs (and headless Service), the control plane's Job controller makes the
pods, and the scheduler places them (CPU pods on the process node, which runs them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import yaml

from localkube import tools
from localkube.cluster import Cluster
from localkube.hosted import HostedController, install_crds
from localkube.training_stack import BUILD, VERSIONS_FILE, home

API_VERSION = "jobset.x-k8s.io/v1alpha2"
# The labels JobSet puts on its Jobs and pods (api/jobset/v1alpha2/jobset_types.go).
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"


def version() -> str:
    """The pinned JobSet release."""
    return tools.read_env(VERSIONS_FILE)["JOBSET_VERSION"]


class JobSet(HostedController):
    """See the module docstring."""

    NAME = "jobset"
    # The release's names: config/default/kustomization.yaml (namespace jobset-system, name
    # prefix jobset-) over config/components/rbac/service_account.yaml (controller-manager).
    NAMESPACE = "jobset-system"
    ACCOUNT = "jobset-controller-manager"
    PREFIX = "jobset-"

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        self.home = home()
        self.binary = tools.executable(self.home, "jobset", BUILD)

    def _start(self, timeout: float) -> None:
        install_crds(self.cluster, (self.home / "jobset" / "crds").glob("*.yaml"))
        kubeconfig = self.identity()
        certs = self.serving_certificate(self.root / "certs")
        self.ports()
        config = self.root / "config.yaml"
        config.write_text(yaml.safe_dump(self.configuration(certs)))
        self.launch([self.binary, "--config", str(config), "--zap-log-level", "3"],
                    kubeconfig, timeout)
        self.apply_webhooks(self.webhook_configurations())

    def configuration(self, certs: Path) -> Dict[str, Any]:
        """JobSet's Configuration (api/config/v1alpha1/configuration_types.go)."""
        return {"apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
                "webhook": {"port": self.webhook_port, "host": "127.0.0.1",
                            "certDir": str(certs)},
                "internalCertManagement": {"enable": False}, **self.manager_settings()}

    def webhook_configurations(self) -> List[Dict[str, Any]]:
        """The module's webhook configurations as the release installs them (module docstring),
        pointed at this process."""
        patches = self.home / "jobset" / "patches"
        # config/components/webhook/kustomization.yaml: which patch targets which configuration.
        docs = self.release_webhooks(self.home / "jobset" / "webhooks.yaml", {
            "MutatingWebhookConfiguration": patches / "mutating-patch.yaml",
            "ValidatingWebhookConfiguration": patches / "validating-patch.yaml"})
        for doc in docs:
            # config/default/kustomization.yaml: namePrefix.
            doc["metadata"]["name"] = self.PREFIX + doc["metadata"]["name"]
        return docs
