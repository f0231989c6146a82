"""Estimation pods on a real kubelet: the webhook holds a Job (and a PyTorchJob)
whose container uses a training image, the controller's estimation pod is scheduled onto the real
node (``localkube/kubelet.py``), which pulls the project's image for the init container that
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

import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest

from tests.realnode.conftest import ENABLED, SKIP_REASON

if not ENABLED:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from localkube import images  # noqa: E402
from localkube.controlplane import wait_for  # noqa: E402
from localkube.kubelet import versions  # noqa: E402
from tests.e2e_real.support import TINY_GPT, job, pytorchjob, template_annotations  # noqa: E402
from tests.realnode.node_cluster import (  # noqa: E402
    NodeCluster,
    Tenant,
    container_statuses,
    diagnostics,
    estimate_of,
    estimation_pod,
    in_image,
    pod_spec,
)
from xmem_admission.cluster import labels  # noqa: E402
from xmem_admission.cluster.controller import podspec  # noqa: E402
from xmem_admission.contract import termination  # noqa: E402

pytestmark = pytest.mark.timeout(3600)

ROOT = Path(__file__).resolve().parents[2]
# The team's package on the image's own PYTHONPATH: the example GPT script as a module.
TEAM_IMAGE = ("COPY teamtrain.py /opt/team/teamtrain.py\n"
              "ENV PYTHONPATH=/opt/team\n")
# A Debian image without any shell: /bin is /usr/bin on bookworm (merged /usr).
NO_SHELL = ('RUN ["/usr/bin/rm", "-f", "/usr/bin/sh", "/usr/bin/bash", "/usr/bin/rbash", '
            '"/usr/bin/dash"]\n')


@pytest.fixture(scope="module")
def on_node(tmp_path_factory: pytest.TempPathFactory, sandbox_image: str, base_image: str,
            project_image: str, training_image: Any) -> Iterator[NodeCluster]:
    local = {
        "team": images.derived(training_image("2.15.0", "3.13"), "team", TEAM_IMAGE,
                               {"teamtrain.py": (ROOT / "examples/train_gpt.py").read_text()}),
        "py39": training_image("2.2.2", "3.9"),
        "no-torch": base_image,
        "no-shell": images.derived(base_image, "no-shell", NO_SHELL),
    }
    running = NodeCluster(tmp_path_factory.mktemp("cluster"), sandbox_image, project_image,
                          local).start()
    try:
        print(f"\nreal node versions: {json.dumps(running.node.versions())}")
        for role, seconds in running.push_seconds.items():
            print(f"pushed {role} as {running.pushed[role]} in {seconds:.0f} s")
        yield running
    finally:
        running.stop()


@pytest.fixture
def tenant(on_node: NodeCluster, request: pytest.FixtureRequest) -> Iterator[Tenant]:
    """An opted-in namespace with the pull secret, the code ConfigMap, a policy of its own,
    its webhook and controller."""
    made = on_node.namespace(f"rn-{len(on_node.tenants)}-{request.node.name[5:25]}".rstrip("-_")
                             .replace("_", "-"))
    try:
        yield made
    finally:
        on_node.leave(made)


def _wait_ended(on_node: NodeCluster, namespace: str, kind: str, name: str,
                timeout: float) -> Dict[str, Any]:
    def ended() -> Optional[Dict[str, Any]]:
        gme = estimate_of(on_node.cluster, namespace, kind, name)
        return gme if (gme.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

    try:
        return wait_for(ended, timeout, f"the estimate of {kind} {name} to end", interval=1)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{diagnostics(on_node.cluster, namespace)}") from err


def _released(on_node: NodeCluster, namespace: str, name: str) -> Dict[str, Any]:
    def released() -> Optional[Dict[str, Any]]:
        obj = on_node.cluster.get("batch/v1", "Job", name, namespace)
        return obj if obj is not None and not obj["spec"].get("suspend") else None

    return wait_for(released, 60, f"Job {name} released")


def test_a_job_and_a_pytorchjob_in_users_images_are_estimated_on_the_real_node_and_released(
        on_node: NodeCluster, tenant: Tenant) -> None:
    cluster, node, namespace = on_node.cluster, on_node.node, tenant.name
    # Torch 2.15 on Python 3.13; the program is a module on the image's own PYTHONPATH; the
    # workload asks for a read-only root file system (HOME and temporary files go to scratch).
    team = in_image(job("team", namespace), on_node.pushed["team"],
                    ["python", "-m", "teamtrain"], list(TINY_GPT))
    spec = team["spec"]["template"]["spec"]
    spec["volumes"] = []
    spec["containers"][0].update(volumeMounts=[],
                                 securityContext={"readOnlyRootFilesystem": True})
    # Torch 2.2 on Python 3.9, a PyTorchJob's master running the script from the ConfigMap.
    old = in_image(pytorchjob("old", namespace), on_node.pushed["py39"])
    started = time.monotonic()
    for obj in (team, old):
        created = cluster.apply(obj)
        assert labels.HELD_REASON in created["metadata"]["annotations"], created

    for kind, name, workload in (("Job", "team", team), ("PyTorchJob", "old", old)):
        gme = _wait_ended(on_node, namespace, kind, name, 900)
        print(f"{kind} {name}: estimate ended after {time.monotonic() - started:.0f} s: "
              f"{json.dumps(gme['status'])[:600]}")
        assert gme["status"]["phase"] == "Succeeded", diagnostics(cluster, namespace)
        pod = estimation_pod(cluster, namespace, gme)
        assert pod["spec"]["nodeName"] == node.name  # the real scheduler's choice, a real kubelet
        seen = container_statuses(pod)
        assert set(seen) == {podspec.INIT_NAME, podspec.IMAGE_ENV_NAME, "train"}, seen
        assert seen[podspec.INIT_NAME]["image"] == on_node.pushed["probe"]
        assert seen[podspec.INIT_NAME]["imageID"].startswith(
            f"{node.registry.address}/xmem/probe@sha256:")
        image = pod_spec(workload)["containers"][0]["image"]
        assert seen[podspec.IMAGE_ENV_NAME]["image"] == seen["train"]["image"] == image
        main = seen["train"]
        assert main["user"]["linux"]["uid"] == podspec.NON_ROOT  # the workload named no user
        ended = main["state"]["terminated"]
        assert ended["reason"] == "Completed", ended
        result = termination.decode(ended["message"])
        assert result.ok and result.steps == 2
        assert {g["gpu"] for g in result.gpus} == {"A100-80GB", "H100-80GB"}
        assert gme["status"]["requestBytes"] >= 1 << 30  # at least the policy's minimumRequest

    released = _released(on_node, namespace, "team")
    assert int(template_annotations(released)[labels.REQUEST_BYTES]) == \
        estimate_of(cluster, namespace, "Job", "team")["status"]["requestBytes"]
    master = cluster.get(old["apiVersion"], "PyTorchJob", "old", namespace)[
        "spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert labels.REQUEST_BYTES in (master["metadata"].get("annotations") or {}), master

    def bound() -> Optional[Dict[str, Any]]:
        pods = cluster.list("v1", "Pod", namespace, "job-name=team")
        return pods[0] if pods and pods[0]["spec"].get("nodeName") else None

    pod = wait_for(bound, 60, "the Job controller's pod to be bound")
    assert pod["spec"]["nodeName"].startswith("real-node-gpu-")
    # Two training images pulled and unpacked: their compressed layers were not kept beside
    # the snapshots (containerd's discard_unpacked_layers).
    disk = node.image_bytes()
    print(f"containerd: content store {disk['content'] / 1e6:.0f} MB, snapshots "
          f"{disk['snapshots'] / 1e6:.0f} MB")
    assert disk["snapshots"] > 4e9 and disk["content"] < 0.02 * disk["snapshots"], disk
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
        on_node: NodeCluster, tenant: Tenant) -> None:
    cluster, namespace = on_node.cluster, tenant.name
    started = time.monotonic()
    for name, role, command, _, _ in FAILING:
        cluster.apply(in_image(job(name, namespace), on_node.pushed[role], command, []))
    for name, _, _, reason, message in FAILING:
        gme = _wait_ended(on_node, namespace, "Job", name, 600)
        status = gme["status"]
        print(f"{name}: {status.get('reason')} after {time.monotonic() - started:.0f} s: "
              f"{status.get('message', '')[:400]}")
        assert (status["phase"], status.get("reason")) == ("Failed", reason), \
            diagnostics(cluster, namespace)
        assert message in status["message"], status["message"]
        pod = estimation_pod(cluster, namespace, gme)
        assert pod["spec"]["nodeName"] == on_node.node.name
        ended = container_statuses(pod)["train"]["state"]["terminated"]
        print(f"{name}: the training container ended {json.dumps(ended)[:300]}")
        if reason == "CannotStart":  # what the process node imitates (localkube/node.py)
            assert (ended["reason"], ended["exitCode"]) == ("StartError", 128), ended
        _released(on_node, namespace, name)
