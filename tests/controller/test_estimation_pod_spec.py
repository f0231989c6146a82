"""The estimation pod: the workload's program, no GPU, the probe injected, valid everywhere."""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Dict

import kubernetes_validate
import pytest

from tests.controller.support import make_policy, training_job
from xmem_admission.cluster.controller import podspec, records

VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34", "1.35")


def _gme(job: Dict[str, Any]) -> Dict[str, Any]:
    gme = records.new(dict(job, metadata=dict(job["metadata"], uid="u-1")), "a" * 32,
                      ["A100-80GB", "H100-80GB"], "img")
    gme["metadata"]["uid"] = "gme-uid"
    return gme


def _build(job: Dict[str, Any], **policy: Any) -> Dict[str, Any]:
    template = job["spec"]["template"]
    return podspec.build(_gme(job), dict(job, metadata=dict(job["metadata"], uid="u-1")),
                         template, template["spec"]["containers"][0], make_policy(**policy).defaults,
                         "registry.example/xmem-admission:1.0")


def _env(pod: Dict[str, Any]) -> Dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom"))
            for e in pod["spec"]["containers"][0]["env"]}


def _rich_job() -> Dict[str, Any]:
    job = training_job("train")
    spec = job["spec"]["template"]["spec"]
    spec.update(nodeSelector={"nvidia.com/gpu.product": "A100"}, serviceAccountName="trainer",
                tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}],
                imagePullSecrets=[{"name": "registry"}],
                securityContext={"runAsUser": 1000, "fsGroup": 1000})
    spec["volumes"] += [
        {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
        {"name": "host", "hostPath": {"path": "/var/lib/x"}},
        {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}},
        {"name": "scratch", "emptyDir": {}},
    ]
    container = spec["containers"][0]
    container["volumeMounts"] += [{"name": "data", "mountPath": "/data"},
                                  {"name": "host", "mountPath": "/host"},
                                  {"name": "token", "mountPath": "/token"},
                                  {"name": "scratch", "mountPath": "/scratch"}]
    container["env"] = [{"name": "PYTHONPATH", "value": "/workspace/src"},
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf",
                                                                          "key": "token"}}}]
    container["envFrom"] = [{"configMapRef": {"name": "settings"}}]
    return job


@pytest.mark.parametrize("version", VERSIONS)
def test_the_estimation_pod_is_valid_for_every_supported_kubernetes(version):
    kubernetes_validate.validate(_build(_rich_job()), version, strict=True)


def test_it_runs_the_same_program_without_any_gpu_or_gpu_node_placement():
    job = _rich_job()
    pod = _build(job, estimation={"resources": {"cpu": "2", "memory": "6Gi"},
                                  "activeDeadlineSeconds": 300})
    main = pod["spec"]["containers"][0]
    original = job["spec"]["template"]["spec"]["containers"][0]
    for key in ("image", "command", "args", "envFrom"):
        assert main[key] == original[key]
    assert main["resources"] == {"limits": {"cpu": "2", "memory": "6Gi"},
                                 "requests": {"cpu": "2", "memory": "6Gi"}}
    spec = pod["spec"]
    assert "nodeSelector" not in spec and "tolerations" not in spec
    assert spec["activeDeadlineSeconds"] == 300 and spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert (spec["serviceAccountName"], spec["imagePullSecrets"]) == ("trainer", [{"name": "registry"}])
    env = _env(pod)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_inputs_are_mounted_read_only_and_host_paths_and_tokens_are_left_out():
    pod = _build(_rich_job())
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert set(volumes) == {"code", "data", "scratch", podspec.PROBE_VOLUME,
                            podspec.SCRATCH_VOLUME}
    assert volumes["data"]["persistentVolumeClaim"]["readOnly"] is True
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["code"]["readOnly"] and mounts["data"]["readOnly"]
    assert mounts["scratch"]["readOnly"] is False
    assert "host" not in mounts and "token" not in mounts


def test_the_probe_is_injected_by_an_init_container_and_pythonpath_first():
    pod = _build(_rich_job(), estimation={"steps": 5, "mode": "Profile"})
    [init] = pod["spec"]["initContainers"]
    assert init["image"] == "registry.example/xmem-admission:1.0"
    assert init["command"] == ["python", "-m", "xmem_admission.bundle", podspec.PROBE_DIR]
    env = _env(pod)
    assert env["PYTHONPATH"] == f"{podspec.PROBE_DIR}:/workspace/src"
    assert (env["XMEM_PROBE"], env["XMEM_PROBE_STEPS"], env["XMEM_PROBE_MODE"]) == ("1", "5", "profile")
    assert env["XMEM_PROBE_GPUS"] == "A100-80GB,H100-80GB"
    assert env["XMEM_RESULT_PATH"] == pod["spec"]["containers"][0]["terminationMessagePath"]


def test_an_image_whose_pythonpath_the_pod_spec_does_not_set_gets_it_read_from_the_image():
    job = training_job("train")  # no PYTHONPATH in the pod spec
    job["spec"]["template"]["spec"]["containers"][0].update(
        image="registry.example/team/train:7", imagePullPolicy="Always",
        securityContext={"runAsUser": 1000})
    pod = _build(job)
    probe, image_env = pod["spec"]["initContainers"]
    assert probe["name"] == podspec.INIT_NAME
    # the workload's image, pulled as the workload's (same policy, same pull secrets)
    assert (image_env["name"], image_env["image"], image_env["imagePullPolicy"]) == \
        (podspec.IMAGE_ENV_NAME, "registry.example/team/train:7", "Always")
    assert image_env["command"][:3] == ["python", "-S", "-c"]  # the command's interpreter
    assert image_env["command"][-1] == f"{podspec.PROBE_DIR}/image-env.json"
    assert "env" not in image_env  # nothing of ours hides the image's PYTHONPATH
    context = image_env["securityContext"]
    assert (context["runAsUser"], context["readOnlyRootFilesystem"]) == (1000, True)
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert _env(pod)["PYTHONPATH"] == podspec.PROBE_DIR
    # a pod spec's PYTHONPATH replaces the image's in the workload's pod too: nothing to read
    assert [c["name"] for c in _build(_rich_job())["spec"]["initContainers"]] == \
        [podspec.INIT_NAME]


@pytest.mark.parametrize(("command", "python"), [
    (["python", "train.py"], "python"),
    (["/opt/conda/bin/python3.11", "-u", "train.py"], "/opt/conda/bin/python3.11"),
    (["torchrun", "--nproc-per-node", "1", "train.py"], "python3"),
    (["bash", "-c", "python train.py"], "python3"),
    (None, "python3"),  # the image's own ENTRYPOINT/CMD
])
def test_the_image_is_read_with_the_interpreter_the_command_names(command, python):
    container = {"name": "train", "image": "img", "command": command}
    assert podspec.interpreter(container) == python


def test_the_probe_gets_a_scratch_folder_for_an_unwritable_home_or_tmp():
    pod = _build(training_job("train"))
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[podspec.SCRATCH_VOLUME] == {"name": podspec.SCRATCH_VOLUME,
                                               "emptyDir": {"sizeLimit": "2Gi"}}
    [mount] = [m for m in pod["spec"]["containers"][0]["volumeMounts"]
               if m["name"] == podspec.SCRATCH_VOLUME]
    assert mount == {"name": podspec.SCRATCH_VOLUME, "mountPath": podspec.SCRATCH_DIR}
    assert _env(pod)["XMEM_PROBE_SCRATCH"] == podspec.SCRATCH_DIR


def test_a_pythonpath_from_a_reference_is_kept_by_expansion():
    job = training_job("train")
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "paths", "key": "pp"}}}]
    env = _env(_build(job))
    assert env["PYTHONPATH"] == f"{podspec.PROBE_DIR}:$({podspec.USER_PYTHONPATH})"
    assert env[podspec.USER_PYTHONPATH] == {"configMapKeyRef": {"name": "paths", "key": "pp"}}


def test_the_pod_is_named_after_its_workload_per_attempt_and_owned_by_its_estimate():
    job = training_job("train")
    gme = _gme(job)
    template = job["spec"]["template"]
    names = []
    for attempt in (1, 2, 3):
        gme["status"] = {"attempt": attempt}
        pod = podspec.build(gme, dict(job, metadata=dict(job["metadata"], uid="u-1")), template,
                            template["spec"]["containers"][0], make_policy().defaults, "img")
        names.append(pod["metadata"]["name"])
    assert all(re.fullmatch(r"train-xmem-[0-9a-f]{8}", name) for name in names), names
    assert len(set(names)) == 3  # each attempt its own
    other = dict(gme, metadata=dict(gme["metadata"], uid="another-unit"))
    assert podspec.pod_name(other) != names[-1]  # and each estimation unit
    [owner] = pod["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("GPUMemoryEstimate", "gme-uid", True)
    assert copy.deepcopy(pod["metadata"]["labels"])["app.kubernetes.io/component"] == "estimation"


def test_a_long_workload_name_is_cut_to_a_63_character_pod_name():
    job = training_job("a-very-long-training-job-name-that-keeps-going.and-going-and-going")
    name = podspec.pod_name(_gme(job))
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    assert len(name) == 63
    assert re.fullmatch(r"a-very-long-training-job-name-that-keeps-going-an-xmem-[0-9a-f]{8}",
                        name), name


def test_the_policys_placement_is_the_estimation_pods_and_the_workloads_is_not():
    placement = {"nodeSelector": {"xmem.io/pool": "cpu"},
                 "tolerations": [{"key": "xmem.io/estimation", "operator": "Exists",
                                  "effect": "NoSchedule"}],
                 "priorityClassName": "batch-low"}
    pod = _build(_rich_job(), estimation={"placement": placement})
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"xmem.io/pool": "cpu"}  # not the GPU product the job asks
    assert spec["tolerations"] == [{"key": "xmem.io/estimation", "operator": "Exists",
                                    "effect": "NoSchedule"}]
    assert spec["priorityClassName"] == "batch-low"
    for version in VERSIONS[-1:]:
        kubernetes_validate.validate(pod, version, strict=True)


def _hostile_job() -> Dict[str, Any]:
    """A workload whose own pod would not pass Pod Security ``restricted`` at all."""
    job = _rich_job()
    spec = job["spec"]["template"]["spec"]
    spec.update(runtimeClassName="gvisor", hostNetwork=True,
                securityContext={"runAsUser": 0, "sysctls": [{"name": "kernel.msgmax",
                                                              "value": "1"}]})
    spec["volumes"].append({"name": "shared", "nfs": {"server": "nfs.example", "path": "/x"}})
    spec["containers"][0]["securityContext"] = {
        "privileged": True, "allowPrivilegeEscalation": True, "runAsUser": 0,
        "capabilities": {"add": ["SYS_ADMIN"]}, "seccompProfile": {"type": "Unconfined"}}
    spec["containers"][0]["volumeMounts"].append({"name": "shared", "mountPath": "/shared"})
    return job


def test_the_estimation_pod_passes_pod_security_restricted_init_container_included(cluster):
    """The real API server's Pod Security admission, in a namespace enforcing ``restricted``,
    judges both (dry run): the hostile workload's pod is refused, its estimation pod is not."""
    from kubernetes import client

    namespace = "pod-security-restricted"
    cluster.ensure_namespace(namespace, {"pod-security.kubernetes.io/enforce": "restricted"})
    cluster.apply({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                   "metadata": {"name": "gvisor"}, "handler": "runsc"})
    cluster.apply({"apiVersion": "v1", "kind": "ServiceAccount",
                   "metadata": {"name": "trainer", "namespace": namespace}})
    core = client.CoreV1Api(cluster.api)
    try:
        hostile = _hostile_job()["spec"]["template"]
        workload = {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "workload", **hostile.get("metadata", {})},
                    "spec": hostile["spec"]}
        with pytest.raises(client.ApiException) as refused:
            core.create_namespaced_pod(namespace, workload, dry_run="All")
        assert refused.value.status == 403
        assert 'violates PodSecurity "restricted:latest"' in \
            json.loads(refused.value.body)["message"]
        pod = _build(_hostile_job())
        pod["metadata"].pop("ownerReferences", None)  # its estimate does not exist here
        pod["metadata"]["namespace"] = namespace
        created = core.create_namespaced_pod(namespace, pod, dry_run="All")
        assert created.metadata.name == pod["metadata"]["name"]
    finally:
        cluster.delete("v1", "Namespace", namespace)
    [init] = pod["spec"]["initContainers"]
    assert init["securityContext"]["runAsNonRoot"] is True
    assert init["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["spec"]["securityContext"]["runAsUser"] != 0
    assert "hostNetwork" not in pod["spec"]


def test_the_estimation_pod_keeps_the_workloads_sandbox_runtime_and_non_root_user():
    pod = _build(_hostile_job())
    assert pod["spec"]["runtimeClassName"] == "gvisor"
    own = _build(_rich_job())  # runAsUser 1000, fsGroup 1000
    assert (own["spec"]["securityContext"]["runAsUser"],
            own["spec"]["securityContext"]["fsGroup"]) == (1000, 1000)
