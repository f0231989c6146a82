"""What the controller records when a sized workload's pod ran out of GPU memory, and what the
webhook reads back (``controller.oom_retries``): the OOM is read from the termination
message of the pod's status (current or last state), never from an exit code or OOMKilled; one
pod counts once, a pod of an older size adds no OOM in a row, a repeated OOM grows
geometrically, the ceiling ends the retries with a reason, and oomRetry off records without a
retry."""

from __future__ import annotations

from typing import Any, Dict, Optional

import pytest

from tests.retry.test_cuda_oom_messages import TORCH_2_4
from xmem_admission.cluster.controller import oom_retries, records
from xmem_admission.cluster.controller.oom_retries import Failure, decide, failure, with_entry
from xmem_admission.cluster.policy import retry
from xmem_admission.cluster.policy.model import Policy, Settings
from xmem_admission.contract import gpus

GiB, MiB = 1 << 30, 1 << 20
NOW = "2026-12-02T19:00:00Z"
# torch 2.4 and later (TORCH_2_4, quoted from Junyi42/monst3r
# issue 51), preceded by the traceback's last lines as the kubelet's log tail keeps them.
TAIL = (
    '  File "/app/train.py", line 41, in <module>\n'
    "    loss = model(batch).sum()\n"
    + TORCH_2_4 + "\n"
)
WORKLOAD = {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "namespace": "ml", "uid": "job-uid"}}


def _settings(**spec: Any) -> Settings:
    body: Dict[str, Any] = {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
                            "granularity": "256Mi"}
    body.update(spec)
    return Policy.from_spec(body).for_namespace("ml")


def _pod(uid: str = "pod-1", message: Optional[str] = TAIL, reason: str = "Error",
         field: str = "state", exit_code: int = 1) -> Dict[str, Any]:
    terminated: Dict[str, Any] = {"exitCode": exit_code, "reason": reason,
                                  "finishedAt": "2026-12-02T18:59:00Z"}
    if message is not None:
        terminated["message"] = message
    status = {"name": "train", field: {"terminated": terminated}}
    if field == "lastState":
        status["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
    return {"metadata": {"name": f"train-{uid}", "namespace": "ml", "uid": uid},
            "spec": {"restartPolicy": "Never"},
            "status": {"phase": "Failed", "containerStatuses": [status]}}


def _failure() -> Failure:
    found = failure(_pod())
    assert found is not None
    return found


def test_the_oom_is_read_from_the_termination_message_current_or_last_state():
    found = failure(_pod())
    assert found is not None and found.container == "train"
    assert found.report.exception == "torch.OutOfMemoryError"
    restarted = failure(_pod(field="lastState"))
    assert restarted is not None and restarted.report.asked_bytes == found.report.asked_bytes


@pytest.mark.parametrize("pod", [
    _pod(message=None),  # exit code 1 and nothing else: not a GPU OOM
    _pod(message=None, reason="OOMKilled", exit_code=137),  # host memory
    _pod(reason="OOMKilled", exit_code=137),  # host memory, whatever the log said
    _pod(message="Traceback (most recent call last):\nValueError: bad batch\n"),
])
def test_anything_but_a_cuda_oom_message_is_no_failure(pod):
    assert failure(pod) is None


def test_a_first_oom_records_the_evidence_and_a_larger_request():
    settings = _settings()
    target = settings.targets[0]
    decision = decide(None, WORKLOAD, _pod(), 40 * GiB, _failure(), target, settings, NOW)
    entry = decision.entry
    assert decision.counted and isinstance(decision.outcome, retry.Retry)
    assert entry is not None and entry["ooms"] == 1 and entry["failedRequestBytes"] == 40 * GiB
    assert entry["workload"] == {"kind": "Job", "name": "train", "uid": "job-uid"}
    assert entry["source"] == "pytorch" and entry["exception"] == "torch.OutOfMemoryError"
    need = entry["needBytes"]
    assert need >= entry["reservedBytes"] + entry["askedBytes"]
    assert entry["requestBytes"] >= need * 1.05 and entry["requestBytes"] % (256 * MiB) == 0
    assert entry["requestBytes"] <= gpus.lookup("A100-80GB").capacity_bytes
    assert "gaveUp" not in entry


def test_the_same_pod_counts_once_and_an_older_sized_pod_adds_no_oom_in_a_row():
    settings = _settings()
    target = settings.targets[0]
    first = decide(None, WORKLOAD, _pod(), 40 * GiB, _failure(), target, settings, NOW).entry
    again = decide(first, WORKLOAD, _pod(), 40 * GiB, _failure(), target, settings, NOW)
    assert again.entry is None and not again.counted
    sibling = decide(first, WORKLOAD, _pod("pod-2"), 40 * GiB, _failure(), target, settings, NOW)
    assert sibling.entry is None and not sibling.counted


def test_a_repeated_oom_at_the_granted_request_grows_by_the_growth_factor():
    settings = _settings(oomRetry={"growthPercent": 50})
    target = settings.targets[0]
    first = decide(None, WORKLOAD, _pod(), 40 * GiB, _failure(), target, settings, NOW).entry
    assert first is not None
    granted = first["requestBytes"]
    second = decide(first, WORKLOAD, _pod("pod-2"), granted, _failure(), target, settings,
                    NOW).entry
    assert second is not None and second["ooms"] == 2
    assert second["requestBytes"] == min(-(-granted * 3 // 2 // (256 * MiB)) * 256 * MiB,
                                         target.gpu.capacity_bytes)


def test_at_the_policys_cap_the_retries_end_with_a_reason():
    settings = _settings(oomRetry={"maxRequest": "50Gi"})
    target = settings.targets[0]
    first = decide(None, WORKLOAD, _pod(), 40 * GiB, _failure(), target, settings, NOW).entry
    assert first is not None and first["requestBytes"] == 50 * GiB  # capped
    last = decide(first, WORKLOAD, _pod("pod-2"), 50 * GiB, _failure(), target, settings, NOW)
    assert isinstance(last.outcome, retry.GiveUp) and last.entry is not None
    assert "50.0 GiB" in last.entry["gaveUp"] and last.entry["requestBytes"] == 50 * GiB
    after = decide(last.entry, WORKLOAD, _pod("pod-3"), 50 * GiB, _failure(), target, settings,
                   NOW)
    assert after.entry is None and not after.counted  # no endless loop of records


def test_with_oom_retry_off_the_oom_is_recorded_and_the_request_kept():
    settings = _settings(oomRetry={"enabled": False})
    decision = decide(None, WORKLOAD, _pod(), 40 * GiB, _failure(), settings.targets[0],
                      settings, NOW)
    assert decision.outcome is None and decision.entry is not None
    assert decision.entry["requestBytes"] == 40 * GiB and "off" in decision.entry["message"]


def test_mig_moves_to_the_next_profile_up():
    settings = _settings(targets=[{"gpu": "A100-80GB", "backend": "MIGMixed"}])
    target = settings.targets[0]
    a100 = gpus.lookup("A100-80GB")
    small = min(a100.mig_profiles, key=lambda p: (p.memory_bytes, p.compute_slices))
    tail = TAIL.replace("47.54 GiB", "9.75 GiB").replace("46.94 GiB", "9.50 GiB").replace(
        "43.08 GiB", "6.00 GiB").replace("2.30 GiB", "1.00 GiB").replace("1.90 GiB", "2.00 GiB")
    found = failure(_pod(message=tail))
    assert found is not None
    entry = decide(None, WORKLOAD, _pod(), small.memory_bytes, found, target, settings,
                   NOW).entry
    assert entry is not None
    profile = gpus.smallest_mig_profile(a100, entry["requestBytes"])
    assert profile is not None and profile.name == entry["migProfile"]
    assert profile.memory_bytes > small.memory_bytes


def test_the_status_keeps_one_entry_per_workload_and_the_webhook_reads_it_as_grants():
    settings = _settings()
    target = settings.targets[0]
    entry = decide(None, WORKLOAD, _pod(), 40 * GiB, _failure(), target, settings, NOW).entry
    assert entry is not None
    other = dict(entry, workload={"kind": "Job", "name": "other", "uid": "other-uid"})
    status = with_entry(with_entry({"phase": "Succeeded"}, entry), other)
    status = with_entry(status, dict(entry, ooms=2))
    assert [e["workload"]["uid"] for e in status[records.OOM_RETRIES]] == ["other-uid", "job-uid"]
    grants = records.retry_grants({"metadata": {"namespace": "ml"}, "status": status})
    mine = [g for g in grants if g.workload_uid == "job-uid"]
    assert len(mine) == 1 and mine[0].ooms == 2 and mine[0].namespace == "ml"
    assert mine[0].request_bytes == entry["requestBytes"] and mine[0].gave_up is None


def test_events_say_what_the_message_said():
    text = oom_retries.describe(_failure().report)
    assert text.startswith("torch.OutOfMemoryError: ") and "GiB reserved by PyTorch" in text
