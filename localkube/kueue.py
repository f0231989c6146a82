"""The real Kueue controller (sigs.k8s.io/kueue, the release in scripts/kueue-versions.env, built
by scripts/build-kueue.sh: ``make tools``) as a host process beside the real control plane.

``Kueue(cluster).start()``:

- applies Kueue's CRDs (from the build's cache entry) and waits for them;
- runs ``kueue`` as the service account ``kueue-system/kueue-controller-manager`` (the identity
  its release manifests give it, which the xmem webhook trusts by default), bound to
  ``cluster-admin`` here: Kueue's own RBAC is not what these tests are about;
- in a mount namespace of its own whose /etc has Kueue's fixed metrics-certificate folder
  (an overlay: nothing on the machine is written);
- with a configuration file: internal certificate management off, the webhook server on
  127.0.0.1 with a serving certificate from the test CA (``pki``), metrics and health on loopback
  ports, no leader election, the integrations in ``frameworks`` only (default: ``batch/job`` and
  ``kubeflow.org/pytorchjob``; ``jobset.x-k8s.io/jobset`` and ``trainer.kubeflow.org/trainjob``
  once ``localkube.jobset``/``localkube.trainer`` installed their CRDs: Kueue's integration
  for a kind needs its CRD), and the on-demand visibility server off (it would need an
  APIService);
- applies Kueue's webhook configurations (from its module) with every ``clientConfig`` turned into
  ``url: https://127.0.0.1:PORT/...`` and the test CA's bundle, as ``cluster.Webhook`` does for
  xmem's; only the entries of Kueue's own kinds and the enabled integrations are kept (the
  others would call paths no framework serves).

The Kubeflow training operator is not built: a PyTorchJob Kueue admits is unsuspended with its
replica templates updated, but no pod is ever created for it.
"""

from __future__ import annotations

import base64
import copy
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from localkube import tools
from localkube.cluster import Cluster
from localkube.controlplane import free_port, stop_process, wait_for
from localkube.hosted import ready

NAMESPACE = "kueue-system"
ACCOUNT = "kueue-controller-manager"
USER = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
VERSIONS_FILE = tools.ROOT / "scripts" / "kueue-versions.env"
FRAMEWORKS = ("batch/job", "kubeflow.org/pytorchjob")
# The webhook paths kept: Kueue's own kinds and the enabled integrations' (Kueue names each path
# after the group, version and kind it serves: config/components/webhook/manifests.yaml).
OWN_PATHS = "kueue-x-k8s-io"
FRAMEWORK_PATHS = {
    "batch/job": "-batch-v1-job",
    "kubeflow.org/pytorchjob": "-kubeflow-org-v1-pytorchjob",
    "jobset.x-k8s.io/jobset": "-jobset-x-k8s-io-v1alpha2-jobset",
    "trainer.kubeflow.org/trainjob": "-trainer-kubeflow-org-v1alpha1-trainjob",
}


def home() -> Path:
    """The built cache entry; raises ``ToolsMissing`` naming the command that builds it."""
    versions = tools.read_env(VERSIONS_FILE)
    cache = os.environ.get("XMEM_KUEUE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "xmem-admission",
        "kueue")
    entry = Path(cache) / f"{versions['KUEUE_VERSION']}_r{versions['KUEUE_BUILD_RECIPE']}"
    if not (entry / ".complete").is_file():
        raise tools.ToolsMissing(f"Kueue is not built ({entry} is missing): run `make tools` "
                                 f"(scripts/build-kueue.sh)")
    return entry


class Kueue:
    """See the module docstring."""

    def __init__(self, cluster: Cluster, frameworks: Sequence[str] = FRAMEWORKS,
                 gates: Optional[Dict[str, bool]] = None,
                 resources: Optional[Dict[str, Any]] = None) -> None:
        """``gates``: Kueue feature gates to set besides the defaults (``VisibilityOnDemand`` is
        always off); ``resources``: the Configuration's ``resources`` (e.g. DRA
        ``deviceClassMappings``)."""
        unknown = sorted(set(frameworks) - set(FRAMEWORK_PATHS))
        if unknown:
            raise ValueError(f"no Kueue integration {unknown} here; known: "
                             f"{sorted(FRAMEWORK_PATHS)}")
        self.cluster = cluster
        self.frameworks = tuple(frameworks)
        self.gates = {"VisibilityOnDemand": False, **(gates or {})}
        self.resources = resources
        self.kept_paths = (OWN_PATHS, *(FRAMEWORK_PATHS[f] for f in self.frameworks))
        self.home = home()
        self.root = cluster.root / "kueue"
        self.process: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 180) -> Kueue:
        crds = [yaml.safe_load(p.read_text()) for p in sorted((self.home / "crds").glob("*.yaml"))]
        for crd in crds:
            self.cluster.apply(crd)
        for crd in crds:
            self.cluster.wait_established(crd["metadata"]["name"])
        self.cluster.ensure_namespace(NAMESPACE)
        self.cluster.apply({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "kueue-tests-cluster-admin"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}]})
        kubeconfig = self.cluster.plane.service_account_kubeconfig(NAMESPACE, ACCOUNT)
        certs = self.root / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        pair = self.cluster.plane._authority().issue(
            "kueue-webhook", "kueue-webhook-service", server=True, ips=["127.0.0.1"],
            dns=["localhost"])
        (certs / "tls.crt").write_bytes(Path(pair.cert).read_bytes())
        (certs / "tls.key").write_bytes(Path(pair.key).read_bytes())
        self.webhook_port, self.health_port = free_port(), free_port()
        config = self.root / "config.yaml"
        config.write_text(yaml.safe_dump(self.configuration(certs)))
        # Without internal certificate management Kueue (v0.17 to v0.19) reads its metrics
        # certificate from a fixed path, /etc/kueue/metrics/certs (cmd/kueue/main.go): the
        # process gets a mount namespace of its own (an unprivileged user namespace) where an
        # overlay on /etc adds that folder, so nothing on the machine is written.
        overlay = self.root / "etc"
        metrics = overlay / "upper" / "kueue" / "metrics" / "certs"
        metrics.mkdir(parents=True, exist_ok=True)
        (overlay / "work").mkdir(exist_ok=True)
        (metrics / "tls.crt").write_bytes(Path(pair.cert).read_bytes())
        (metrics / "tls.key").write_bytes(Path(pair.key).read_bytes())
        argv = [str(self.home / "bin" / "kueue"), "--config", str(config),
                "--kubeconfig", str(kubeconfig), "--feature-gates",
                ",".join(f"{gate}={str(on).lower()}" for gate, on in sorted(self.gates.items())),
                "--zap-log-level", "3"]
        mount = (f"mount -t overlay overlay -o lowerdir=/etc,upperdir={overlay / 'upper'},"
                 f"workdir={overlay / 'work'} /etc")
        log = open(self.cluster.plane.logs / "kueue.log", "ab")  # noqa: SIM115 - the child's
        try:
            self.process = subprocess.Popen(
                ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                 f'{mount} && exec "$@"', "kueue", *argv],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        wait_for(self._ready, timeout, "Kueue to be ready (log: "
                 f"{self.cluster.plane.logs / 'kueue.log'})", interval=0.5)
        for doc in self.webhook_configurations():
            self.cluster.apply(doc)
        return self

    def configuration(self, certs: Path) -> Dict[str, Any]:
        """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2, Kueue's
        config/components/manager/controller_manager_config.yaml, adapted to a host process)."""
        config: Dict[str, Any] = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": list(self.frameworks)},
        }
        if self.resources is not None:
            config["resources"] = self.resources
        return config

    def _ready(self) -> bool:
        assert self.process is not None
        return ready(self.cluster, "kueue", self.process, self.health_port)

    def webhook_configurations(self) -> List[Dict[str, Any]]:
        ca = base64.b64encode(self.cluster.plane._authority().pem).decode()
        out = []
        for doc in yaml.safe_load_all((self.home / "webhooks.yaml").read_text()):
            if not doc:
                continue
            doc = copy.deepcopy(doc)
            doc["metadata"]["name"] = f"kueue-{doc['metadata']['name']}"
            kept = []
            for webhook in doc["webhooks"]:
                path = webhook["clientConfig"]["service"]["path"]
                if not any(p in path for p in self.kept_paths):
                    continue
                webhook["clientConfig"] = {"url": f"https://127.0.0.1:{self.webhook_port}{path}",
                                           "caBundle": ca}
                # The release's kustomization keeps Kueue away from its own namespace and
                # kube-system (config/components/webhook/kustomization.yaml).
                webhook["namespaceSelector"] = {"matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                     "values": ["kube-system", NAMESPACE]}]}
                kept.append(webhook)
            doc["webhooks"] = kept
            out.append(doc)
        return out

    def stop(self) -> None:
        for doc in self.webhook_configurations():
            self.cluster.delete(doc["apiVersion"], doc["kind"], doc["metadata"]["name"])
        if self.process is not None:
            stop_process(self.process, grace=10)
            self.process = None
