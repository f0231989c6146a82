"""The real Kubeflow Trainer v2 controller manager (github.com/kubeflow/trainer/v2, the release in
scripts/trainer-versions.env, built with JobSet by scripts/build-trainer.sh: ``make tools``) as a
host process beside the real control plane. A TrainJob becomes a JobSet, so Trainer needs JobSet.

``Trainer(cluster).start()``:

- starts JobSet (``localkube.jobset``) unless one is given (``Trainer(cluster, jobset=...)``);
  a JobSet it started is stopped with it;
- applies Trainer's CRDs (TrainJob, TrainingRuntime, ClusterTrainingRuntime) and waits for them;
- runs ``trainer`` (cmd/trainer-controller-manager) as the service account its release manifests
  give it (``kubeflow-system/kubeflow-trainer-controller-manager``), bound to ``cluster-admin``;
- with a configuration file (config.trainer.kubeflow.org/v1alpha1, the release's
  manifests/base/manager/controller_manager_config.yaml adapted to a host process): certificate
  management off, the webhook server on 127.0.0.1, metrics off, health on a loopback port, no
  leader election. Trainer's configuration has no certificate folder: controller-runtime's
  webhook server reads ``$TMPDIR/k8s-webhook-server/serving-certs`` (pkg/webhook/server.go,
  ``os.TempDir()``), so the process gets a ``TMPDIR`` of its own holding the test CA's serving
  certificate there, where the release mounts its Secret at /tmp/...;
- applies Trainer's webhook configurations as its release does (the module's
  manifests/base/webhook/manifests.yaml with the release's patches: the names
  ``defaulter.trainer.kubeflow.org`` and ``validator.trainer.kubeflow.org``, the runtimes'
  ``trainer.kubeflow.org/webhook-validation`` object selector), pointed at the host process;
- applies the ClusterTrainingRuntimes named in ``runtimes`` from the ones Trainer ships
  (manifests/base/runtimes; default: ``torch-distributed``), through Trainer's own validating
  webhook.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import yaml

from localkube import tools
from localkube.cluster import Cluster
from localkube.hosted import HostedController, install_crds, load_all
from localkube.jobset import BUILD, VERSIONS_FILE, JobSet, home

API_VERSION = "trainer.kubeflow.org/v1alpha1"
TORCH_RUNTIME = "torch-distributed"
# The labels Trainer puts on the JobSet it makes of a TrainJob (pkg/constants/constants.go).
TRAINJOB_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"


def version() -> str:
    """The pinned Trainer release."""
    return tools.read_env(VERSIONS_FILE)["TRAINER_VERSION"]


def shipped_runtimes() -> Dict[str, Dict[str, Any]]:
    """The ClusterTrainingRuntimes Trainer ships (manifests/base/runtimes), by name."""
    out = {}
    for path in sorted((home() / "trainer" / "runtimes").glob("*.yaml")):
        for doc in load_all(path):
            if doc.get("kind") == "ClusterTrainingRuntime":
                out[doc["metadata"]["name"]] = doc
    return out


class Trainer(HostedController):
    """See the module docstring."""

    NAME = "trainer"
    # The release's names: manifests/overlays/manager/kustomization.yaml (namespace
    # kubeflow-system) over manifests/base/rbac/service_account.yaml.
    NAMESPACE = "kubeflow-system"
    ACCOUNT = "kubeflow-trainer-controller-manager"

    def __init__(self, cluster: Cluster, jobset: Optional[JobSet] = None,
                 runtimes: Sequence[str] = (TORCH_RUNTIME,)) -> None:
        super().__init__(cluster)
        self.home = home()
        self.binary = tools.executable(self.home, "trainer", BUILD)
        self.jobset = jobset
        self.owns_jobset = jobset is None
        self.runtimes = tuple(runtimes)
        unknown = sorted(set(self.runtimes) - set(shipped_runtimes()))
        if unknown:
            raise ValueError(f"Trainer ships no ClusterTrainingRuntime {unknown}; it ships "
                             f"{sorted(shipped_runtimes())}")

    def _start(self, timeout: float) -> None:
        if self.jobset is None:
            self.jobset = JobSet(self.cluster).start(timeout)
        install_crds(self.cluster, (self.home / "trainer" / "crds").glob("*.yaml"))
        kubeconfig = self.identity()
        tmp = self.root / "tmp"
        self.serving_certificate(tmp / "k8s-webhook-server" / "serving-certs")
        self.ports()
        config = self.root / "config.yaml"
        config.write_text(yaml.safe_dump(self.configuration()))
        self.launch([self.binary, "--config", str(config), "--zap-log-level", "3"],
                    kubeconfig, timeout, env={"TMPDIR": str(tmp)})
        self.apply_webhooks(self.webhook_configurations())
        shipped = shipped_runtimes()
        for name in self.runtimes:
            self.cluster.apply(shipped[name])

    def configuration(self) -> Dict[str, Any]:
        """Trainer's Configuration (pkg/apis/config/v1alpha1/configuration_types.go)."""
        return {"apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
                "webhook": {"port": self.webhook_port, "host": "127.0.0.1"},
                "certManagement": {"enable": False}, **self.manager_settings()}

    def webhook_configurations(self) -> List[Dict[str, Any]]:
        """The module's webhook configurations as the release installs them (module docstring),
        pointed at this process."""
        patches = self.home / "trainer" / "patches"
        # manifests/base/webhook/kustomization.yaml: which patch targets which configuration.
        return self.release_webhooks(self.home / "trainer" / "webhooks.yaml", {
            "MutatingWebhookConfiguration": patches / "patch_mutating.yaml",
            "ValidatingWebhookConfiguration": patches / "patch_validating.yaml"})

    def stop(self) -> None:
        super().stop()
        if self.owns_jobset and self.jobset is not None:
            self.jobset.stop()
            self.jobset = None

