"""Estimation pods on a real kubelet (#29, item 4): the webhook holds a Job (and a PyTorchJob)
whose container uses a training image, the controller's estimation pod is scheduled onto the real
node (``tests/realkube/kubelet.py``), which pulls the project's image for the init container that
writes the probe bundle and the workload's image for the training container, from a local
registry that requires authentication (the workload's pull secret); the probe's result comes back
as the container's termination message, the workload is released, and its pod is sized and bound
to a kwok GPU node. The webhook and the controller run as processes here (``Cluster``).

The images: the project's (`make image`), and training images standing for users' (Debian's
Python and torch from PyPI, scripts/training-image.sh): torch 2.15 on Python 3.13 with a package
of the team's own on the image's ``PYTHONPATH`` (Dockerfile ``ENV``) that the job's command runs
(``python -m teamtrain``), and torch 2.2 on Python 3.9. Images that cannot be estimated (no
torch, a command that is not Python, a command that needs a shell the image lacks) each end with a
named reason on the GPUMemoryEstimate, within the estimation deadline, and release the workload.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from tests.realnode.conftest import ENABLED, SKIP_REASON

if not ENABLED:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from tests.e2e_real.support import code_map, job, policy, pytorchjob, template_annotations  # noqa: E402
from tests.realkube import images  # noqa: E402
from tests.realkube.cluster import Cluster  # noqa: E402
from tests.realkube.controlplane import ControlPlane, wait_for  # noqa: E402
from tests.realkube.kubelet import RealNode, versions  # noqa: E402
from tests.realkube.kwok import gpu_node  # noqa: E402
from xmem_admission.cluster import labels  # noqa: E402
from xmem_admission.cluster.controller import podspec  # noqa: E402
from xmem_admission.contract import termination  # noqa: E402

pytestmark = pytest.mark.timeout(3600)

ROOT = Path(__file__).resolve().parents[2]
AUTH = ("xmem-tests", secrets.token_hex(8))
PULL_SECRET = "registry-credentials"
GPU_POOL = {"pool": "real-node-gpus"}
# The team's package on the image's own PYTHONPATH: the example GPT script as a module.
TEAM_IMAGE = ("COPY teamtrain.py /opt/team/teamtrain.py\n"
              "ENV PYTHONPATH=/opt/team\n")
# A Debian image without any shell: /bin is /usr/bin on bookworm (merged /usr).
NO_SHELL = ('RUN ["/usr/bin/rm", "-f", "/usr/bin/sh", "/usr/bin/bash", "/usr/bin/rbash", '
            '"/usr/bin/dash"]\n')


@dataclass
class Setup:
    cluster: Cluster
    node: RealNode
    images: Dict[str, str]  # role -> reference in the node's registry
    namespaces: List[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, sandbox_image: str, base_image: str,
          project_image: str, training_image: Any) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("cluster")
    started: Dict[str, RealNode] = {}

    def start_node(plane: ControlPlane) -> RealNode:
        node = RealNode(plane, root / "node", registry_auth=AUTH)
        started["node"] = node
        try:
            return node.start(sandbox_image)
        except BaseException:
            node.stop()
            raise

    local = {
        "team": images.derived(training_image("2.15.0", "3.13"), "team", TEAM_IMAGE,
                               {"teamtrain.py": (ROOT / "examples/train_gpt.py").read_text()}),
        "py39": training_image("2.2.2", "3.9"),
        "no-torch": base_image,
        "no-shell": images.derived(base_image, "no-shell", NO_SHELL),
    }
    cluster = Cluster(root / "plane", start_node=start_node)
    try:
        cluster.start()
        node = started["node"]
        pushed: Dict[str, str] = {}
        for role, reference in [("probe", project_image), *local.items()]:
            began = time.monotonic()
            pushed[role] = node.registry.push(reference, f"xmem/{role}:test")
            print(f"\npushed {reference} as {pushed[role]} in {time.monotonic() - began:.0f} s")
        cluster.probe_image = pushed["probe"]
        for i in range(2):
            cluster.apply(gpu_node(f"real-node-gpu-{i}", labels=dict(GPU_POOL)))
        print(f"real node versions: {json.dumps(node.versions())}")
        yield Setup(cluster, node, pushed)
    finally:
        cluster.stop()


@pytest.fixture
def xmem(setup: Setup, request: pytest.FixtureRequest) -> Iterator[Setup]:
    """An opted-in namespace with the pull secret and the code ConfigMap, a policy of its own,
    the webhook and the controller."""
    cluster = setup.cluster
    namespace = f"rn-{len(setup.namespaces)}"
    setup.namespaces.append(namespace)
    cluster.ensure_namespace(namespace, {labels.OPT_IN: "true"})
    wait_for(lambda: cluster.get("v1", "ServiceAccount", "default", namespace), 30,
             f"the default service account of {namespace}")
    registry = setup.node.registry.address
    token = base64.b64encode(f"{AUTH[0]}:{AUTH[1]}".encode()).decode()
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
                   "metadata": {"name": PULL_SECRET, "namespace": namespace},
                   "stringData": {".dockerconfigjson": json.dumps(
                       {"auths": {registry: {"auth": token}}})}})
    cluster.apply(code_map(namespace))
    cluster.apply(policy(namespace, estimation={"resources": {"cpu": "1", "memory": "3Gi"},
                                                "activeDeadlineSeconds": 600}))
    webhook = cluster.serve(f"serve-{namespace}", namespace)
    controller = cluster.controller(f"controller-{namespace}", namespace)
    try:
        yield setup
    finally:
        cluster.stop_process(controller)
        webhook.remove()
        webhook.stop()
        cluster.delete("v1", "Namespace", namespace)


def _pod_spec(obj: Dict[str, Any]) -> Dict[str, Any]:
    if obj["kind"] == "PyTorchJob":
        return obj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


def _workload(obj: Dict[str, Any], image: str, command: Optional[List[str]] = None,
              args: Optional[List[str]] = None) -> Dict[str, Any]:
    spec = _pod_spec(obj)
    spec["imagePullSecrets"] = [{"name": PULL_SECRET}]
    spec["nodeSelector"] = dict(GPU_POOL)
    container = spec["containers"][0]
    container["image"] = image
    if command is not None:
        container["command"] = command
    if args is not None:
        container["args"] = args
    return obj


def _estimate(cluster: Cluster, namespace: str, kind: str, name: str) -> Dict[str, Any]:
    for gme in cluster.list("xmem.io/v1alpha1", "GPUMemoryEstimate", namespace):
        refs = gme["metadata"].get("ownerReferences") or []
        if any(r["kind"] == kind and r["name"] == name for r in refs):
            return gme
    return {}


def _ended(cluster: Cluster, namespace: str, kind: str, name: str) -> Optional[Dict[str, Any]]:
    gme = _estimate(cluster, namespace, kind, name)
    phase = (gme.get("status") or {}).get("phase")
    return gme if phase in ("Succeeded", "Failed") else None


def _estimation_pod(cluster: Cluster, namespace: str, gme: Dict[str, Any]) -> Dict[str, Any]:
    pods = [p for p in cluster.list("v1", "Pod", namespace, "app.kubernetes.io/component=estimation")
            if any(r["uid"] == gme["metadata"]["uid"]
                   for r in p["metadata"].get("ownerReferences") or [])]
    assert pods, f"no estimation pod of {gme['metadata']['name']}"
    return pods[-1]


def _diagnostics(setup: Setup, namespace: str) -> str:
    cluster = setup.cluster
    events = "\n".join(f"{e['involvedObject']['name']}: {e['reason']}: {e['message']}"
                       for e in cluster.list("v1", "Event", namespace))
    gmes = json.dumps([g.get("status") for g in
                       cluster.list("xmem.io/v1alpha1", "GPUMemoryEstimate", namespace)],
                      indent=1)
    return (f"events:\n{events}\nestimates:\n{gmes}\ncontroller log:\n"
            f"{cluster.log(f'controller-{namespace}')[-3000:]}")


def _wait_ended(setup: Setup, namespace: str, kind: str, name: str,
                timeout: float) -> Dict[str, Any]:
    try:
        return wait_for(lambda: _ended(setup.cluster, namespace, kind, name), timeout,
                        f"the estimate of {kind} {name} to end", interval=1)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{_diagnostics(setup, namespace)}") from err


def _statuses(pod: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    status = pod["status"]
    return {s["name"]: s for s in (status.get("initContainerStatuses") or [])
            + (status.get("containerStatuses") or [])}


def test_a_job_and_a_pytorchjob_in_users_images_are_estimated_on_the_real_node_and_released(
        xmem: Setup) -> None:
    cluster, node = xmem.cluster, xmem.node
    namespace = xmem.namespaces[-1]
    tiny = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2"]
    # Torch 2.15 on Python 3.13; the program is a module on the image's own PYTHONPATH; the
    # workload asks for a read-only root file system (HOME and temporary files go to scratch).
    team = _workload(job("team", namespace), xmem.images["team"],
                     ["python", "-m", "teamtrain"], tiny)
    team_container = _pod_spec(team)["containers"][0]
    team_container["volumeMounts"] = []
    team_container["securityContext"] = {"readOnlyRootFilesystem": True}
    _pod_spec(team)["volumes"] = []
    # Torch 2.2 on Python 3.9, a PyTorchJob's master running the script from the ConfigMap.
    old = _workload(pytorchjob("old", namespace), xmem.images["py39"])
    started = time.monotonic()
    cluster.apply(team)
    cluster.apply(old)
    for kind, name in (("Job", "team"), ("PyTorchJob", "old")):
        obj = cluster.get(team["apiVersion"] if kind == "Job" else old["apiVersion"], kind,
                          name, namespace)
        assert obj is not None and labels.HELD_REASON in obj["metadata"]["annotations"], obj

    for kind, name in (("Job", "team"), ("PyTorchJob", "old")):
        gme = _wait_ended(xmem, namespace, kind, name, 900)
        print(f"{kind} {name}: estimate ended after {time.monotonic() - started:.0f} s: "
              f"{json.dumps(gme['status'])[:600]}")
        assert gme["status"]["phase"] == "Succeeded", _diagnostics(xmem, namespace)
        pod = _estimation_pod(cluster, namespace, gme)
        assert pod["spec"]["nodeName"] == node.name  # the real scheduler's choice, a real kubelet
        seen = _statuses(pod)
        assert set(seen) == {podspec.INIT_NAME, podspec.IMAGE_ENV_NAME, "train"}, seen
        assert seen[podspec.INIT_NAME]["image"] == xmem.images["probe"]
        assert seen[podspec.INIT_NAME]["imageID"].startswith(f"{node.registry.address}/xmem/probe@sha256:")
        for name_ in (podspec.IMAGE_ENV_NAME, "train"):
            assert seen[name_]["image"] == _pod_spec(team if name == "team" else old)[
                "containers"][0]["image"]
        main = seen["train"]
        assert main["user"]["linux"]["uid"] == podspec.NON_ROOT  # 65532: the workload named none
        ended = main["state"]["terminated"]
        assert ended["reason"] == "Completed", ended
        result = termination.decode(ended["message"])
        assert result.ok and result.steps == 2
        assert {g["gpu"] for g in result.gpus} == {"A100-80GB", "H100-80GB"}
        request = gme["status"]["requestBytes"]
        assert request >= 1 << 30  # the policy's minimumRequest

    released = wait_for(lambda: (lambda j: j if not j["spec"].get("suspend") else None)(
        cluster.get("batch/v1", "Job", "team", namespace)), 60, "Job team released")
    assert int(template_annotations(released)[labels.REQUEST_BYTES]) == \
        _estimate(cluster, namespace, "Job", "team")["status"]["requestBytes"]
    pytorch = cluster.get(old["apiVersion"], "PyTorchJob", "old", namespace)
    master = pytorch["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert labels.REQUEST_BYTES in (master["metadata"].get("annotations") or {}), master

    def bound() -> Optional[Dict[str, Any]]:
        pods = cluster.list("v1", "Pod", namespace, "job-name=team")
        return pods[0] if pods and pods[0]["spec"].get("nodeName") else None

    pod = wait_for(bound, 60, "the Job controller's pod to be bound")
    assert pod["spec"]["nodeName"].startswith("real-node-gpu-")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and "nvidia.com/gpumem" in limits
    print(f"kubelet {versions()['KUBERNETES_VERSION']}, containerd "
          f"{versions()['CONTAINERD_VERSION']}: both estimated and released in "
          f"{time.monotonic() - started:.0f} s")


FAILING = [
    # (job, image role, command, the estimate's reason, what its message says)
    ("no-torch", "no-torch", ["python3", "/app/train_gpt.py"], "TorchNotFound",
     "cannot import torch: No module named 'torch'"),
    ("not-python", "no-torch", ["sleep", "1"], "NoResult",
     "exited 0 without a result"),
    ("no-shell", "no-shell", ["sh", "-c", "python3 /app/train_gpt.py"], "CannotStart",
     '"sh": executable file not found'),
]


def test_images_that_cannot_be_estimated_end_with_a_named_reason_and_release_the_job(
        xmem: Setup) -> None:
    cluster = xmem.cluster
    namespace = xmem.namespaces[-1]
    started = time.monotonic()
    for name, role, command, _, _ in FAILING:
        cluster.apply(_workload(job(name, namespace), xmem.images[role], command, []))
    for name, _, _, reason, message in FAILING:
        gme = _wait_ended(xmem, namespace, "Job", name, 600)
        status = gme["status"]
        print(f"{name}: {status.get('reason')} after {time.monotonic() - started:.0f} s: "
              f"{status.get('message', '')[:400]}")
        assert (status["phase"], status.get("reason")) == ("Failed", reason), \
            _diagnostics(xmem, namespace)
        assert message in status["message"], status["message"]
        pod = _estimation_pod(cluster, namespace, gme)
        assert pod["spec"]["nodeName"] == xmem.node.name
        wait_for(lambda n=name: not cluster.get("batch/v1", "Job", n, namespace)["spec"].get(
            "suspend"), 60, f"Job {name} released")
