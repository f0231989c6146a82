"""Trials that need a trace share one estimation pod (``controller.batches``): the probe starts
the interpreter and imports torch once, then forks a trace per estimate. On the real control
plane, with one estimation pod at a time in the namespace (the traces without a slot ride in
the pods of those with one), a sweep's trials are traced in fewer pods than traced estimates, each estimate gets its
own result and a command line that reproduces it, and a trial that fails ends its own estimate
only, its pod kept for ``kubectl logs``. The probe's side runs as the estimation container
runs it (the bundle on ``PYTHONPATH``): a trace killed by SIGKILL or past its own deadline does
not lose the others' results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

from tests.controller.support import (
    SCRIPTS,
    Harness,
    make_policy,
    policy_spec,
    training_job,
    wait,
)
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import podspec, records
from xmem_admission.contract import probe_env, termination

BASE = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100", "--seq-len", "32",
        "--steps", "2"]


def _trial(name: str, batch_size: str, *extra: str) -> Dict[str, Any]:
    return training_job(name, args=BASE + ["--batch-size", batch_size, *extra])


def _estimate(harness: Harness, job: str) -> Dict[str, Any]:
    """The estimate the job waited on, once the job is released (sized, or as written)."""
    released = harness.wait_released(job, timeout=300)
    found = harness.get("xmem.io/v1alpha1", "GPUMemoryEstimate", records.name_for(
        released["metadata"]["annotations"][labels.FINGERPRINT]))
    assert found is not None
    return found


def test_a_sweeps_traces_share_pods_and_each_estimate_gets_its_own_result(
        harness: Harness) -> None:
    harness.use(policy_spec(estimation={"maxConcurrentPerNamespace": 1}))
    sizes = ("2", "4", "8", "16")
    for size in sizes:  # all held before the controller starts: one dispatch sees them all
        harness.submit(_trial(f"bs-{size}", size))
    harness.controller()
    gmes = {size: _estimate(harness, f"bs-{size}") for size in sizes}
    assert all(records.phase(g) == records.SUCCEEDED for g in gmes.values())
    # --batch-size is learned from the first two traces (one pod), then the two batch sizes
    # left are traced together (a second pod): two pods for four traces.
    pods = {g["status"]["podName"] for g in gmes.values()}
    assert len(pods) == 2, {s: g["status"]["podName"] for s, g in gmes.items()}
    assert all(p.startswith("bs-") and podspec.POD_INFIX in p for p in pods)
    assert len({g["status"]["allocationDigest"] for g in gmes.values()}) == len(sizes)
    for size, gme in gmes.items():
        assert f"--batch-size {size} " in gme["status"]["reproduce"] + " "
        assert "sharedFrom" not in gme["status"]
    wait(lambda: not harness.estimation_pods(), 60,
         "the pods to be deleted once every estimate they carried has its result")


def test_a_trial_that_fails_ends_its_own_estimate_and_its_pod_is_kept_for_logs(
        harness: Harness) -> None:
    harness.use(policy_spec(estimation={"maxConcurrentPerNamespace": 1}))
    harness.submit(_trial("good", "2", "--optimizer", "adamw"))
    harness.submit(_trial("bad", "2", "--optimizer", "nonesuch"))
    harness.controller()
    good, bad = _estimate(harness, "good"), _estimate(harness, "bad")
    assert good["status"]["podName"] == bad["status"]["podName"]  # one pod traced both
    assert records.phase(good) == records.SUCCEEDED and good["status"]["allocationDigest"]
    assert records.phase(bad) == records.FAILED
    assert bad["status"]["reason"] == "ScriptFailed"
    assert bad["status"]["message"] == "the script exited with status 2"  # argparse's
    [pod] = harness.estimation_pods()
    assert pod["metadata"]["name"] == bad["status"]["podName"]
    assert sorted(pod["metadata"]["annotations"][podspec.CARRIED].split(",")) == \
        sorted([good["metadata"]["name"], bad["metadata"]["name"]])


def _sweep_trial(name: str, width: str, end: str) -> Dict[str, Any]:
    return training_job(name, script="sweep_trial.py", args=["--width", width, "--end", end])


def test_a_pod_that_runs_out_of_memory_fails_the_trace_under_way_and_the_rest_trace_again(
        harness: Harness) -> None:
    harness.use(policy_spec(estimation={"maxConcurrentPerNamespace": 1}))
    harness.submit(_sweep_trial("a-first", "64", "train"))
    harness.submit(_sweep_trial("b-hog", "64", "hogs"))
    harness.submit(_sweep_trial("c-last", "128", "train"))
    harness.controller()
    first, hog, last = (_estimate(harness, n) for n in ("a-first", "b-hog", "c-last"))
    pod = first["status"]["podName"]
    assert hog["status"]["podName"] == pod  # the three started in one pod
    assert records.phase(first) == records.SUCCEEDED and first["status"]["allocationDigest"]
    assert records.phase(hog) == records.FAILED and hog["status"]["reason"] == "OOMKilled"
    # The trace not run when the pod died waited for another pod and was traced there.
    assert records.phase(last) == records.SUCCEEDED and last["status"]["podName"] != pod
    assert last["status"]["attempt"] == 2


def test_the_pod_of_several_traces_has_one_traces_resources_and_a_deadline_for_all() -> None:
    settings = make_policy().defaults
    bodies = []
    for index, size in enumerate(("2", "4", "8")):
        job = _trial(f"t{index}", size)
        job["metadata"]["namespace"] = "default"
        gme = {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUMemoryEstimate",
               "metadata": {"name": f"gme-{index}", "uid": f"uid-{index}",
                            "namespace": "default"},
               "spec": {"fingerprint": f"{index:032x}", "gpus": ["A100-80GB", "H100-80GB"],
                        "workload": {"kind": "Job", "name": f"t{index}"}}}
        template = job["spec"]["template"]
        bodies.append((gme, podspec.build(gme, job, template, template["spec"]["containers"][0],
                                          settings, "probe:latest")))
    first = bodies[0][1]
    traces = [(gme, podspec.batchable(first, body)) for gme, body in bodies]
    assert all(words is not None for _, words in traces)
    single = json.loads(json.dumps(first))
    pod = podspec.carry(first, traces, settings)
    main, alone = pod["spec"]["containers"][0], single["spec"]["containers"][0]
    assert main["resources"] == alone["resources"]  # one trace at a time: one trace's room
    deadline = settings.estimation.active_deadline_seconds
    assert pod["spec"]["activeDeadlineSeconds"] == 3 * deadline
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env[probe_env.TRACE_SECONDS] == str(deadline)
    assert [t["estimate"] for t in podspec.carried(pod)] == ["gme-0", "gme-1", "gme-2"]
    assert [t["words"][-1] for t in podspec.carried(pod)] == ["2", "4", "8"]
    owners = pod["metadata"]["ownerReferences"]
    assert [(o["uid"], o.get("controller", False)) for o in owners] == \
        [("uid-0", True), ("uid-1", False), ("uid-2", False)]
    # Another program, or the same one with another environment, rides in no one's pod.
    other = _trial("t9", "2")
    other["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "SEED", "value": "1"}]
    other_body = podspec.build(bodies[0][0], other, other["spec"]["template"],
                               other["spec"]["template"]["spec"]["containers"][0], settings,
                               "probe:latest")
    assert podspec.batchable(single, other_body) is None


def test_a_killed_or_hung_trace_loses_none_of_the_others_results(tmp_path: Path) -> None:
    bundle = tmp_path / "probe"
    subprocess.run([sys.executable, "-m", "xmem_admission.bundle", str(bundle)], check=True,
                   capture_output=True)
    script = str(SCRIPTS / "sweep_trial.py")
    words: List[List[str]] = [["python", script, "--width", "64", "--end", end]
                              for end in ("train", "killed", "hangs", "fails")]
    words.append(["python", script, "--width", "256", "--end", "train"])
    result = tmp_path / "termination-log"
    env = {"PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"]),
           "HOME": str(tmp_path), "PYTHONPATH": str(bundle), probe_env.ON: probe_env.ON_VALUE,
           probe_env.GPUS: "A100-80GB", probe_env.STEPS: "2", probe_env.MODE: "fake",
           probe_env.RESULT_PATH: str(result), "CUDA_VISIBLE_DEVICES": "",
           probe_env.BATCH: json.dumps({"estimates": list("abcde"), "argv": words}),
           probe_env.TRACE_SECONDS: "15"}
    done = subprocess.run(words[0], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    batch = termination.decode_batch(result.read_text())
    assert batch is not None and batch.running is None
    assert [e.status if e else None for e in batch.entries] == \
        ["ok", "oom_killed", "deadline_exceeded", "script_error", "ok"]
    first, last = batch.entries[0], batch.entries[-1]
    assert first is not None and last is not None and first.digest != last.digest
    assert last.gpus[0]["total_bytes"] > 0
    # Each trace ran its own command line, in a process of its own.
    assert "--width 256 --end train" in done.stderr
    failed = batch.entries[3]
    assert failed is not None and "ValueError: bad arguments: --end fails" in failed.traceback
