"""A DRA claim xmem writes is allocated, prepared and run on a real kubelet (the must-show
"where a DRA kubelet plugin can run on the real node").

The real node (``localkube/kubelet.py``: kubelet 1.36.3, containerd 2.4.2) runs the Kubernetes
project's example DRA driver, ``sigs.k8s.io/dra-example-driver`` v0.4.0, as a host process beside
the kubelet (``localkube/dra_plugin.py``, configured as its Helm chart's DaemonSet, with the
chart's DeviceClass ``gpu.example.com``). Its plugin publishes simulated GPUs for the node: 80Gi
of ``memory`` and 100 ``compute`` each, shareable (``allowMultipleAllocations``, request policy
min 1Gi step 1Gi) when the chart's ``gpuAllowMultipleAllocations`` is on, which the chart leaves
off by default. Preparing a claim writes a CDI spec whose edits are environment variables
(the device, its consumed capacity, the claim's UID), which containerd injects.

xmem runs as the chart runs it (webhook and controller as processes, ``localkube/cluster.py``)
with a policy ``backend: DRA``, ``deviceClass: gpu.example.com``, ``pinProduct: false`` (the
example devices carry an attribute ``model``, not the ``productName`` xmem pins). A Job is held,
its estimate recorded as a finished estimation records it (17 GiB peak: an 18 GiB request), and
the controller releases it with xmem's ResourceClaimTemplate; the real kube-scheduler allocates
the claim on the real node's device, the kubelet has the plugin prepare it, and the container
prints what the plugin injected.

Not a GPU: the example driver's devices do not exist and nothing limits memory; this shows the
claim's path through a real kubelet and a real DRA plugin, not enforcement.

Run here (2026-12-04, 2 cores, cgroup v1): 3 passed in 118 s and in 73 s. The plugin's slice is
published and the kubelet has registered it 1.2-1.6 s after it starts; the held Job's pod runs
11-17 s after submission; allocation ``consumedCapacity`` ``{memory: 18Gi, compute: "100"}``:
xmem asks no ``compute``, so its request-policy default (the whole device) is charged and two
18 GiB claims cannot share one 80Gi example device (the second pod: "0/1 nodes are available:
1 cannot allocate all claims" until the first is done).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from tests.realnode.conftest import ENABLED, SKIP_REASON, _script

if not ENABLED:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kubernetes import client  # noqa: E402

from localkube import dra_plugin  # noqa: E402
from localkube.cluster import Cluster, Webhook  # noqa: E402
from localkube.controlplane import ControlPlane, Exited, wait_for  # noqa: E402
from localkube.kubelet import RealNode, _tail  # noqa: E402
from tests.e2e_real.support import job, policy  # noqa: E402
from tests.support.estimates import record_dict  # noqa: E402
from xmem_admission.cluster import labels  # noqa: E402
from xmem_admission.cluster.controller.gme_store import KubeStore  # noqa: E402
from xmem_admission.cluster.kube.client import Kube  # noqa: E402
from xmem_admission.cluster.kube.quantity import GiB, parse_bytes  # noqa: E402
from xmem_admission.cluster.policy.store import EstimateRecord  # noqa: E402

pytestmark = pytest.mark.timeout(3600)

RESOURCE = "resource.k8s.io/v1"
DRA = {"driver": "Nvidia", "deviceClass": dra_plugin.DRIVER, "pinProduct": False}
# The spec the plugin writes at start (cdi.go CreateCommonSpecFile; the CDI library's name).
COMMON_SPEC = "k8s.gpu.example.com-gpu_common.yaml"
GATE = "/gate"  # a hostPath folder (Tenant.gate): the container waits for a file "open"
# Prints what the plugin injected (every variable of its CDI specs), then, when the pod asks
# for it, waits until the test opens the gate.
SCRIPT = (
    "import json, os, pathlib, sys, time\n"
    "env = {k: v for k, v in os.environ.items()\n"
    "       if k.startswith(('GPU_DEVICE_', 'DRA_')) or k == 'KUBERNETES_NODE_NAME'}\n"
    "print(json.dumps(env, sort_keys=True), flush=True)\n"
    "gate = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else None\n"
    "deadline = time.monotonic() + 600\n"
    "while gate is not None and not (gate / 'open').exists() and time.monotonic() < deadline:\n"
    "    time.sleep(0.2)\n"
)


@pytest.fixture(scope="module")
def on_node(tmp_path_factory: pytest.TempPathFactory, sandbox_image: str,
            base_image: str) -> Iterator[Tuple[Cluster, RealNode, str]]:
    """The control plane with the chart's objects, the real node, and the Debian image pushed
    into the node's registry. The plugin is built first when missing (`make node-tools`)."""
    _script("scripts/build-dra-driver.sh")
    root = tmp_path_factory.mktemp("dra")
    started: Dict[str, RealNode] = {}

    def start_node(plane: ControlPlane) -> RealNode:
        node = RealNode(plane, root / "node")
        started["node"] = node
        try:
            return node.start(sandbox_image)
        except BaseException:
            node.stop()
            raise

    cluster = Cluster(root / "plane", start_node=start_node)
    try:
        cluster.start()
        node = started["node"]
        image = node.registry.push(base_image, "xmem/debian:bookworm")
        print(f"\nreal node versions: {json.dumps(node.versions())}; plugin "
              f"{dra_plugin.BINARY} {dra_plugin.versions()['DRA_DRIVER_VERSION']}")
        yield cluster, node, image
    finally:
        cluster.stop()


class Tenant:
    """An opted-in namespace with a dra policy of its own and its webhook; the controller is
    started by the test once the estimate is recorded (no estimation pod is run here)."""

    def __init__(self, cluster: Cluster, node: RealNode, image: str, name: str) -> None:
        self.cluster, self.node, self.image, self.name = cluster, node, image, name
        cluster.ensure_namespace(name, {labels.OPT_IN: "true"})
        wait_for(lambda: cluster.get("v1", "ServiceAccount", "default", name), 30,
                 f"the default service account of {name}")
        cluster.apply(policy(name, backend="DRA", gpus=("H200",), dra=dict(DRA)))
        self.webhook: Webhook = cluster.serve(f"serve-{name}", name)
        self.controller: Any = None
        self.core = client.CoreV1Api(cluster.api)

    def gate(self, name: str) -> Path:
        """The host folder a Job's container waits on (``open`` lets it finish)."""
        return self.node.root / "gates" / name

    def open(self, name: str) -> None:
        (self.gate(name) / "open").write_text("")

    def job(self, name: str, gated: bool = True) -> Dict[str, Any]:
        """A one-GPU Job for the real node, in the Debian image, printing what it was given
        and, ``gated``, running until ``open(name)``."""
        body = job(name, self.name, args=(), gpu_resources={"cpu": "100m", "memory": "128Mi"},
                   node_selector={"kubernetes.io/hostname": self.node.name})
        spec = body["spec"]["template"]["spec"]
        spec.update({"dnsPolicy": "Default", "terminationGracePeriodSeconds": 0,
                     "volumes": []})
        container = spec["containers"][0]
        container.update({"image": self.image, "command": ["python3", "-c", SCRIPT],
                          "args": [], "volumeMounts": []})
        if gated:
            gate = self.gate(name)
            gate.mkdir(parents=True, exist_ok=True)
            spec["volumes"] = [{"name": "gate", "hostPath": {"path": str(gate),
                                                             "type": "Directory"}}]
            container["volumeMounts"] = [{"name": "gate", "mountPath": GATE}]
            container["args"] = [GATE]
        return body

    def hold(self, *bodies: Dict[str, Any], peak_gib: float = 17.0) -> List[str]:
        """Create the Jobs (held by the webhook), record their estimate, start the controller."""
        batch: Any = client.BatchV1Api(self.cluster.api)
        fingerprints = set()
        for body in bodies:
            created = batch.create_namespaced_job(self.name, body).to_dict()
            assert created["spec"]["suspend"] is True, created["spec"]
            fingerprints.add(created["metadata"]["annotations"][labels.FINGERPRINT])
        (fingerprint,) = fingerprints
        data = record_dict(fingerprint, {"H200": peak_gib})
        data["workload"] = {"namespace": self.name, "kind": "Job",
                            "name": bodies[0]["metadata"]["name"]}
        KubeStore(Kube(self.cluster.api)).put(EstimateRecord.from_dict(data))
        self.controller = self.cluster.controller(f"controller-{self.name}", self.name,
                                                  "--no-leader-election")
        return [b["metadata"]["name"] for b in bodies]

    def released(self, name: str) -> Dict[str, Any]:
        def done() -> Optional[Dict[str, Any]]:
            obj = self.cluster.get("batch/v1", "Job", name, self.name)
            assert obj is not None, f"job {name} is gone"
            held = labels.HELD_REASON in (obj["metadata"].get("annotations") or {})
            return None if held or obj["spec"].get("suspend") else obj
        released: Dict[str, Any] = self.wait(done, 120, f"Job {name} released")
        return released

    def pod(self, job_name: str) -> Dict[str, Any]:
        pods = self.cluster.list("v1", "Pod", self.name, f"job-name={job_name}")
        return pods[0] if pods else {}

    def claim_of(self, pod: Dict[str, Any]) -> Dict[str, Any]:
        (status,) = pod["status"]["resourceClaimStatuses"]
        claim = self.cluster.get(RESOURCE, "ResourceClaim", status["resourceClaimName"],
                                 self.name)
        assert claim is not None
        return claim

    def phase(self, job_name: str, wanted: str) -> Optional[Dict[str, Any]]:
        pod = self.pod(job_name)
        phase = (pod.get("status") or {}).get("phase")
        if phase == "Failed" and wanted != "Failed":
            raise Exited(f"pod of {job_name} failed: {json.dumps(pod.get('status'))}")
        return pod if phase == wanted else None

    def events(self, name: str = "") -> List[Dict[str, Any]]:
        return [e for e in self.cluster.list("v1", "Event", self.name)
                if not name or e["involvedObject"]["name"] == name]

    def wait(self, check: Any, timeout: float, what: str) -> Any:
        try:
            return wait_for(check, timeout, what, interval=0.5)
        except (TimeoutError, Exited) as err:
            events = "\n".join(f"{e['involvedObject']['name']}: {e['reason']}: {e['message']}"
                               for e in self.events())
            raise AssertionError(
                f"{err}\nevents:\n{events}\ncontroller log:\n"
                f"{self.cluster.log(f'controller-{self.name}')[-2500:]}\nkubelet log:\n"
                f"{_tail(self.node.logs / 'kubelet.log', 25)}\nplugin log:\n"
                f"{_tail(self.node.logs / f'{dra_plugin.BINARY}.log', 25)}") from err

    def printed(self, pod: Dict[str, Any]) -> Dict[str, str]:
        """The variables the container printed (its log's first line), once it has."""
        def line() -> Optional[str]:
            log = self.core.read_namespaced_pod_log(pod["metadata"]["name"], self.name,
                                                    container="train")
            return log.splitlines()[0] if log.strip() else None
        return dict(json.loads(self.wait(line, 60, "the container's first line")))

    def leave(self) -> None:
        if self.controller is not None:
            self.cluster.stop_process(self.controller)
        self.webhook.remove()
        self.webhook.stop()
        self.cluster.delete("v1", "Namespace", self.name)


@pytest.fixture
def tenant(on_node: Tuple[Cluster, RealNode, str],
           request: pytest.FixtureRequest) -> Iterator[Tenant]:
    cluster, node, image = on_node
    made = Tenant(cluster, node, image, f"dra-{request.node.name[5:30]}".rstrip("-_")
                  .replace("_", "-"))
    try:
        yield made
    finally:
        made.leave()


def _driver(node: RealNode, shared: bool) -> dra_plugin.ExampleDriver:
    began = time.monotonic()
    driver = dra_plugin.ExampleDriver(node, devices=1, shared=shared).start()
    print(f"plugin (shared={shared}) published its slice and was registered "
          f"{time.monotonic() - began:.1f} s after start")
    return driver


def test_a_held_jobs_claim_is_prepared_by_the_plugin_and_its_pod_runs_on_the_real_node(
        tenant: Tenant) -> None:
    node = tenant.node
    driver = _driver(node, shared=True)
    try:
        (slice_,) = driver.slices()
        print(f"ResourceSlice: {json.dumps(slice_['spec'])}")
        assert slice_["spec"]["pool"]["name"] == node.name
        (device,) = slice_["spec"]["devices"]
        assert device["name"] == "gpu-0" and device["allowMultipleAllocations"] is True
        memory = device["capacity"]["memory"]
        assert parse_bytes(memory["value"]) == 80 * GiB
        assert {k: parse_bytes(v) for k, v in memory["requestPolicy"]["validRange"].items()} == \
            {"min": GiB, "step": GiB, "max": 80 * GiB}
        assert device["capacity"]["compute"]["value"] == "100"
        assert device["attributes"]["model"] == {"string": "LATEST-GPU-MODEL"}
        assert driver.cdi_specs()[COMMON_SPEC]["kind"] == "k8s.gpu.example.com/gpu"

        began = time.monotonic()
        (name,) = tenant.hold(tenant.job("dra-runs"))
        tenant.released(name)
        template = tenant.cluster.get(RESOURCE, "ResourceClaimTemplate",
                                      f"{name}-xmem-18432mi", tenant.name)
        assert template is not None, "the controller made no ResourceClaimTemplate"
        exactly = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
        assert exactly["deviceClassName"] == dra_plugin.DRIVER
        assert parse_bytes(exactly["capacity"]["requests"]["memory"]) == 18 * GiB
        assert "selectors" not in exactly  # pinProduct off

        pod = tenant.wait(lambda: tenant.phase(name, "Running"), 300,
                          f"the pod of {name} to run on the real node")
        running = time.monotonic() - began
        assert pod["spec"]["nodeName"] == node.name
        assert pod["spec"]["resourceClaims"] == [
            {"name": "xmem-gpu", "resourceClaimTemplateName": f"{name}-xmem-18432mi"}]
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["claims"] == [{"name": "xmem-gpu"}]
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})

        claim = tenant.claim_of(pod)
        uid = claim["metadata"]["uid"]
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        print(f"allocation: {json.dumps(result)}")
        assert (result["driver"], result["pool"], result["device"]) == \
            (dra_plugin.DRIVER, node.name, "gpu-0")
        assert parse_bytes(result["consumedCapacity"]["memory"]) == 18 * GiB
        # xmem asks no compute: the scheduler charges the request policy's default, the whole.
        assert result["consumedCapacity"]["compute"] == "100"
        assert result.get("shareID")

        # Prepared: the plugin's CDI spec for this claim, which containerd applied.
        spec = driver.cdi_specs()[f"k8s.gpu.example.com-gpu_{uid}.yaml"]
        (device,) = spec["devices"]
        assert device["name"] == f"{uid}-gpu-0-{result['shareID']}"
        given = tenant.printed(pod)
        print(f"the container saw: {json.dumps(given)} (Running {running:.1f} s after "
              f"submission)")
        assert set(device["containerEdits"]["env"]) <= {f"{k}={v}" for k, v in given.items()}
        assert given["GPU_DEVICE_0"] == "gpu-0"
        assert given["GPU_DEVICE_0_MEMORY"] == "18Gi"
        assert given["GPU_DEVICE_0_COMPUTE"] == "100"
        assert given["GPU_DEVICE_0_SHARING_STRATEGY"] == "TimeSlicing"
        assert given["GPU_DEVICE_GPU_0_RESOURCE_CLAIM"] == uid
        assert given["DRA_RESOURCE_DRIVER_NAME"] == dra_plugin.DRIVER
        assert given["KUBERNETES_NODE_NAME"] == node.name

        tenant.open(name)
        done = tenant.wait(lambda: tenant.phase(name, "Succeeded"), 120,
                           f"the pod of {name} to run to completion")
        (state,) = [s["state"]["terminated"] for s in done["status"]["containerStatuses"]]
        assert state["exitCode"] == 0
        print(f"{name} Succeeded {time.monotonic() - began:.1f} s after submission")
        # The pod is done: the kubelet has the plugin unprepare the claim (its CDI spec goes)
        # and the resourceclaim controller deletes the claim it made for the pod.
        tenant.wait(lambda: set(driver.cdi_specs()) == {COMMON_SPEC}, 120,
                    "the claim's CDI spec to be removed once the pod is done")
        tenant.wait(lambda: tenant.cluster.get(RESOURCE, "ResourceClaim",
                                               claim["metadata"]["name"], tenant.name) is None,
                    120, "the pod's claim to be deleted")
    finally:
        driver.stop()


def test_two_18_gib_claims_do_not_share_an_example_device_because_the_claim_asks_no_compute(
        tenant: Tenant) -> None:
    """The device could hold both by memory (80Gi), but a claim that asks no ``compute``
    consumes its request policy's default, the whole 100: the second pod waits until the first
    is done. xmem's look before writing counts memory only, so it released both."""
    driver = _driver(tenant.node, shared=True)
    try:
        first, second = tenant.hold(tenant.job("dra-first"), tenant.job("dra-second"))
        for name in (first, second):
            tenant.released(name)
        running = tenant.wait(lambda: tenant.phase(first, "Running") or
                              tenant.phase(second, "Running"), 300, "one of the pods Running")
        runs = running["metadata"]["labels"]["job-name"]
        waits = second if runs == first else first

        def refused() -> Optional[Dict[str, Any]]:
            found = [e for e in tenant.events(tenant.pod(waits)["metadata"]["name"])
                     if e["reason"] == "FailedScheduling"]
            return found[-1] if found else None

        event = tenant.wait(refused, 120, f"the scheduler to say why {waits} waits")
        print(f"while {runs} runs, {waits}: {event['message']}")
        assert not tenant.pod(waits)["spec"].get("nodeName")
        (result,) = tenant.claim_of(running)["status"]["allocation"]["devices"]["results"]
        assert result["consumedCapacity"] == {"memory": "18Gi", "compute": "100"}

        tenant.open(runs)
        tenant.wait(lambda: tenant.phase(runs, "Succeeded"), 120, f"{runs} to finish")
        pod = tenant.wait(lambda: tenant.phase(waits, "Running"), 300,
                          f"{waits} to run once the device is free")
        assert tenant.printed(pod)["GPU_DEVICE_0_MEMORY"] == "18Gi"
        tenant.open(waits)
        tenant.wait(lambda: tenant.phase(waits, "Succeeded"), 120, f"{waits} to finish")
    finally:
        driver.stop()


def test_with_the_charts_default_no_shared_device_xmem_releases_without_a_claim_and_says_why(
        tenant: Tenant) -> None:
    """The chart's default, ``gpuAllowMultipleAllocations: false``: the devices have a
    ``memory`` capacity but cannot be shared, so xmem's look before writing refuses the class."""
    driver = _driver(tenant.node, shared=False)
    try:
        (device,) = driver.slices()[0]["spec"]["devices"]
        assert "allowMultipleAllocations" not in device or not device["allowMultipleAllocations"]
        assert "requestPolicy" not in device["capacity"]["memory"]
        (name,) = tenant.hold(tenant.job("dra-whole", gated=False))
        released = tenant.released(name)
        why = released["metadata"]["annotations"]["xmem.io/dra-unsatisfiable"]
        print(f"xmem.io/dra-unsatisfiable: {why}")
        assert f"DeviceClass {dra_plugin.DRIVER} has no shareable device" in why
        assert tenant.cluster.list(RESOURCE, "ResourceClaimTemplate", tenant.name) == []
        (event,) = tenant.wait(lambda: [e for e in tenant.events(name)
                                        if e["reason"] == "NoShareableDevice"], 60,
                               "the NoShareableDevice Event")
        print(f"Event {event['type']} {event['reason']}: {event['message']}")
        assert event["type"] == "Warning" and "released as written" in event["message"]
        pod = tenant.wait(lambda: tenant.pod(name) or None, 60, "the Job's pod")
        assert not pod["spec"].get("resourceClaims")
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    finally:
        driver.stop()
