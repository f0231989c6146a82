"""The chart as a user installs it: `helm install` with the project's image from the
real node's registry (which requires authentication: the chart's ``imagePullSecrets``). The
certificate hook Jobs, the webhook and the controller run as pods on the real kubelet
(``localkube/kubelet.py``); pods reach the API server through the ``kubernetes`` Service
(kube-proxy in iptables mode, the API server on the host's address) and the API server calls
the webhook through its Service. Then a Job goes through the chart's own pods: held at CREATE,
estimated by an estimation pod the in-cluster controller starts on the real node, released, and
its pod sized and bound to a kwok GPU node. `helm uninstall` leaves nothing of the chart running.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from tests.realnode.conftest import ENABLED, SKIP_REASON

if not ENABLED:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import yaml  # noqa: E402

from localkube.cluster import CHART, helm  # noqa: E402
from localkube.controlplane import ControlPlane, wait_for  # noqa: E402
from localkube.kubelet import RealNode, _host_address  # noqa: E402
from localkube.kwok import TEST_STAGES, Kwok, gpu_node  # noqa: E402
from tests.e2e_real.support import TINY_GPT, code_map, job  # noqa: E402
from tests.realnode.node_cluster import GPU_POOL, PULL_SECRET, in_image  # noqa: E402
from xmem_admission.cluster import labels  # noqa: E402

pytestmark = pytest.mark.timeout(3600)

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "xmem"
NAMESPACE = "xmem-system"
AUTH = ("xmem-chart", "chart-" + str(int(time.time())))


class Installed:
    def __init__(self, plane: ControlPlane, node: RealNode, pushed: Dict[str, str]) -> None:
        self.plane = plane
        self.node = node
        self.pushed = pushed
        from kubernetes import client

        self.api = plane.api_client()
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.logs: Dict[str, str] = {}

    def helm(self, *args: str, values: Optional[Dict[str, Any]] = None,
             timeout: float = 900) -> str:
        argv = [helm(), *args, "--kubeconfig", str(self.plane.admin_kubeconfig),
                "--namespace", NAMESPACE]
        if values is not None:
            argv += ["--values", "-"]
        stop = threading.Event()
        watcher = threading.Thread(target=self._keep_logs, args=(stop,), daemon=True)
        watcher.start()
        try:
            done = subprocess.run(argv, input=yaml.safe_dump(values or {}),
                                  capture_output=True, text=True, timeout=timeout)
        finally:
            stop.set()
            watcher.join(10)
        assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stderr}\n{self.story()}"
        return done.stdout

    def _keep_logs(self, stop: threading.Event) -> None:
        """The chart's pods' logs while helm runs (a failed hook's pod is deleted with it)."""
        while not stop.wait(1):
            try:
                for pod in self.pods(NAMESPACE):
                    for status in pod.status.container_statuses or []:
                        for previous in (False, True):
                            if previous and not status.restart_count:
                                continue
                            text = self.core.read_namespaced_pod_log(
                                pod.metadata.name, NAMESPACE, container=status.name,
                                previous=previous)
                            if text:
                                self.logs[f"{pod.metadata.name}/{status.name}"
                                          f"{' (previous)' if previous else ''}"] = text
            except Exception:  # noqa: BLE001, S112 - a pod went between list and read
                continue

    def pods(self, namespace: str) -> List[Any]:
        return list(self.core.list_namespaced_pod(namespace).items)

    def story(self) -> str:
        """What happened, for a failure: pods, events, the chart pods' logs."""
        lines = []
        for namespace in (NAMESPACE, "chart-tenant"):
            try:
                for pod in self.pods(namespace):
                    lines.append(f"pod {namespace}/{pod.metadata.name} on {pod.spec.node_name}: "
                                 f"{pod.status.phase} {json.dumps(pod.status.to_dict(), default=str)[:800]}")
                for event in self.core.list_namespaced_event(namespace).items:
                    lines.append(f"event {event.involved_object.name}: {event.reason}: "
                                 f"{event.message}")
            except Exception as exc:  # noqa: BLE001 - a failure report must not fail
                lines.append(f"{namespace}: {exc}")
        for name, text in self.logs.items():
            lines.append(f"log of {name}:\n{text[-2000:]}")
        return "\n".join(lines)[-16000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, sandbox_image: str, project_image: str,
              training_image: Any) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("chart")
    chains_before = _nat_chains()
    plane = ControlPlane(root / "plane", address=_host_address())
    kwok = Kwok(plane, TEST_STAGES)
    node = RealNode(plane, root / "node", registry_auth=AUTH, services=True)
    try:
        plane.start()
        kwok.start()
        node.start(sandbox_image)
        pushed = {"probe": node.registry.push(project_image, "xmem/admission:test"),
                  "train": node.registry.push(training_image("2.15.0", "3.13"),
                                              "team/train:2.15")}
        yield Installed(plane, node, pushed)
    finally:
        node.stop()
        kwok.stop()
        plane.stop()
    # kube-proxy's chains went with the node (kube-proxy --cleanup)
    assert not {c for c in _nat_chains() - chains_before if c.startswith("KUBE-")}


def _nat_chains() -> set:
    listed = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True)
    return {line.split()[1] for line in listed.stdout.splitlines() if line.startswith("-N ")}


REACH = (
    "import os, ssl, urllib.error, urllib.request\n"
    "url = 'https://%s:%s/version' % (os.environ['KUBERNETES_SERVICE_HOST'],"
    " os.environ['KUBERNETES_SERVICE_PORT'])\n"
    "context = ssl.create_default_context(cafile="
    "'/var/run/secrets/kubernetes.io/serviceaccount/ca.crt')\n"
    "token = open('/var/run/secrets/kubernetes.io/serviceaccount/token').read()\n"
    "request = urllib.request.Request(url, headers={'Authorization': 'Bearer ' + token})\n"
    "print(url, urllib.request.urlopen(request, context=context, timeout=10).read().decode())\n")


def _a_pod_reaches_the_api_server_through_its_service(installed: Installed) -> None:
    """What the chart's pods need first: the `kubernetes` Service (kube-proxy's rules, the route
    to the Service range), with the pod's own service-account token and CA."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reach"},
           "spec": {"restartPolicy": "Never", "imagePullSecrets": [{"name": PULL_SECRET}],
                    "dnsPolicy": "Default", "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "main", "image": installed.pushed["probe"],
                                    "command": ["python", "-c", REACH]}]}}
    installed.core.create_namespaced_pod(NAMESPACE, pod)

    def ended() -> Optional[str]:
        phase = installed.core.read_namespaced_pod("reach", NAMESPACE).status.phase
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for(ended, 180, "the pod that calls the API server to end", interval=0.5)
    logs = installed.core.read_namespaced_pod_log("reach", NAMESPACE)
    print(f"\nfrom a pod on the real node: {logs.strip()}")
    assert phase == "Succeeded", f"{logs}\n{installed.story()}"
    assert '"gitVersion": "v1.36.3"' in logs or '"gitVersion":"v1.36.3"' in logs, logs
    installed.core.delete_namespaced_pod("reach", NAMESPACE)


def _values(installed: Installed) -> Dict[str, Any]:
    repository, tag = installed.pushed["probe"].rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag},
        "imagePullSecrets": [{"name": PULL_SECRET}],
        "webhook": {"replicas": 1, "workloads": {"pytorchJobs": False}},
        "policy": {"spec": {"estimation": {"resources": {"cpu": "1", "memory": "3Gi"},
                                           "activeDeadlineSeconds": 600, "steps": 2}}},
    }


def test_the_chart_installed_with_helm_runs_on_the_real_node_and_sizes_a_job(
        installed: Installed) -> None:
    core, node = installed.core, installed.node
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    core.create_namespaced_secret(NAMESPACE, node.registry.pull_secret(PULL_SECRET))
    _a_pod_reaches_the_api_server_through_its_service(installed)
    began = time.monotonic()
    installed.helm("install", RELEASE, str(CHART), "--wait", "--timeout", "10m",
                   values=_values(installed))
    print(f"\nhelm install --wait: {time.monotonic() - began:.0f} s")
    pods = installed.pods(NAMESPACE)
    running = [p for p in pods if p.status.phase == "Running"]
    assert {p.metadata.labels.get("app.kubernetes.io/component") for p in running} >= \
        {"webhook", "controller"}, installed.story()
    assert all(p.spec.node_name == node.name for p in running)
    for pod in running:
        for status in pod.status.container_statuses:
            assert status.image_id.startswith(f"{node.registry.address}/xmem/admission@sha256:")
    # the certificate hook wrote the CA into both webhook configurations
    from kubernetes import client

    admission = client.AdmissionregistrationV1Api(installed.api)
    for listed in (admission.list_mutating_webhook_configuration(),
                   admission.list_validating_webhook_configuration()):
        [configuration] = [c for c in listed.items if c.metadata.name.startswith(RELEASE)]
        assert all(w.client_config.ca_bundle for w in configuration.webhooks)
        assert all(w.client_config.service is not None for w in configuration.webhooks)

    tenant = "chart-tenant"
    core.create_namespace({"metadata": {"name": tenant, "labels": {labels.OPT_IN: "true"}}})
    wait_for(lambda: core.read_namespaced_service_account("default", tenant), 30,
             "the tenant's default service account")
    core.create_namespaced_secret(tenant, node.registry.pull_secret(PULL_SECRET))
    core.create_namespaced_config_map(tenant, code_map(tenant))
    body = in_image(job("train", tenant, args=list(TINY_GPT)), installed.pushed["train"])
    for i in range(2):
        core.create_node(gpu_node(f"chart-gpu-{i}", labels=dict(GPU_POOL)))
    created = installed.batch.create_namespaced_job(tenant, body)
    # held at CREATE by the chart's webhook pod, which the API server reached through its Service
    assert created.spec.suspend is True, created.metadata.annotations
    assert labels.HELD_REASON in created.metadata.annotations

    def released() -> Optional[Any]:
        obj = installed.batch.read_namespaced_job("train", tenant)
        return obj if not obj.spec.suspend else None

    try:
        job_now = wait_for(released, 900, "the Job released by the in-cluster controller",
                           interval=1)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{installed.story()}") from err
    annotations = job_now.spec.template.metadata.annotations or {}
    assert int(annotations[labels.REQUEST_BYTES]) >= 1 << 30, annotations
    [estimation] = [p for p in installed.pods(tenant)
                    if (p.metadata.labels or {}).get("app.kubernetes.io/component") == "estimation"]
    assert estimation.spec.node_name == node.name
    assert estimation.spec.init_containers[0].image == installed.pushed["probe"]

    def bound() -> Optional[Any]:
        pods = [p for p in installed.pods(tenant) if (p.metadata.labels or {}).get("job-name")]
        return pods[0] if pods and pods[0].spec.node_name else None

    pod = wait_for(bound, 60, "the Job's pod bound to a GPU node")
    assert pod.spec.node_name.startswith("chart-gpu-")
    assert "nvidia.com/gpumem" in pod.spec.containers[0].resources.limits
    print(f"a Job held, estimated and released through the chart's pods in "
          f"{time.monotonic() - began:.0f} s since helm install")

    installed.helm("uninstall", RELEASE, "--wait", "--timeout", "5m")
    wait_for(lambda: not [p for p in installed.pods(NAMESPACE)], 120,
             "no pod of the chart left")
    assert not [c for c in admission.list_mutating_webhook_configuration().items
                if c.metadata.name.startswith(RELEASE)]
