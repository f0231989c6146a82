"""The estimate store and its file format, the fingerprint, and request sizing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.builders import make_job, make_pod, make_pytorchjob, review
from tests.support.estimates import record_dict, workload_fingerprint
from tests.support.harness import LocalWebhook, make_policy
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.store import EstimateRecord, MemoryStore
from xmem_admission.contract.errors import EstimateRecordError

GPUS = ("A100-80GB", "H100-80GB")
GiB, MiB = 1 << 30, 1 << 20


def test_a_directory_of_estimate_files_seeds_the_store(tmp_path: Path) -> None:
    one = record_dict("a" * 32, {"NVIDIA A100-SXM4-80GB": 10.0})  # a CUDA device name
    many = [record_dict("b" * 32, {"H100-80GB": 5.0}), record_dict("c" * 32, {"A30": 3.0})]
    many[0]["workload"] = {"namespace": "ml", "kind": "Job", "name": "train"}
    (tmp_path / "one.json").write_text(json.dumps(one))
    (tmp_path / "many.json").write_text(json.dumps(many))
    (tmp_path / "notes.txt").write_text("not an estimate")
    store = MemoryStore.from_directory(str(tmp_path))
    assert len(store) == 3
    record = store.get("a" * 32, "ml")  # no namespace in the file: the admin's, for every one
    assert record is not None and record.gpus[0].gpu == "A100-80GB"
    assert record.gpus[0].total_bytes == 10 * GiB
    assert store.get("a" * 32, "elsewhere") == record
    assert str(store.get("b" * 32, "ml").workload) == "ml/Job/train"
    assert store.get("b" * 32, "team-b") is None  # recorded for ml: sizes ml's workloads only
    assert store.get("d" * 32, "ml") is None
    assert EstimateRecord.from_dict(record.to_dict()) == record


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("fingerprint"), "'fingerprint' must be a non-empty string"),
        (lambda d: d.update(gpus=[]), "'gpus' must be a non-empty list"),
        (lambda d: d["gpus"][0].update(gpu="A100-90GB"), "gpus[0].gpu: unknown GPU 'A100-90GB'"),
        (lambda d: d["gpus"][0].update(total_bytes=-1), "gpus[0].total_bytes: must be a non-negative"),
        (lambda d: d["gpus"][0].update(fits="yes"), "gpus[0].fits: must be true or false"),
        (lambda d: d.update(workload={"name": "x"}), "'workload' must have string namespace"),
    ],
)
def test_a_malformed_estimate_file_is_refused_naming_file_and_field(
    tmp_path: Path, change: Any, message: str
) -> None:
    data = record_dict("e" * 32, {"A100-80GB": 10.0})
    change(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(EstimateRecordError) as caught:
        MemoryStore.from_directory(str(tmp_path))
    assert str(tmp_path / "bad.json") in str(caught.value) and message in str(caught.value)


def test_files_that_are_not_json_or_not_a_directory_are_refused(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(EstimateRecordError, match="not JSON"):
        MemoryStore.from_directory(str(tmp_path))
    with pytest.raises(EstimateRecordError, match="not a directory"):
        MemoryStore.from_directory(str(tmp_path / "x.json"))


def test_the_fingerprint_ignores_env_order_and_per_pod_variables() -> None:
    a = make_job("a").gpus(1).env("LR", "3e-4").env("BATCH", "32").obj()
    b = make_job("b").gpus(1).env("BATCH", "32").env("HOSTNAME", "node-7").env("LR", "3e-4").obj()
    assert workload_fingerprint(a, GPUS) == workload_fingerprint(b, GPUS)


@pytest.mark.parametrize(
    "variant",
    [
        lambda b: b.image("ghcr.io/acme/train:1.1"),
        lambda b: b.args("--batch-size", "64"),
        lambda b: b.env("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        lambda b: b.gpus(2),
    ],
)
def test_the_fingerprint_changes_with_what_changes_memory(variant: Any) -> None:
    base = make_job("a").gpus(1)
    changed = variant(make_job("a").gpus(1))
    assert workload_fingerprint(base.obj(), GPUS) != workload_fingerprint(changed.obj(), GPUS)


def test_the_fingerprint_covers_the_target_gpus_and_names_secrets_not_their_values() -> None:
    job = make_job("a").gpus(1).obj()
    assert workload_fingerprint(job, GPUS) != workload_fingerprint(job, ("A100-80GB",))
    assert workload_fingerprint(job, GPUS) == workload_fingerprint(job, tuple(reversed(GPUS)))
    secret = make_job("s").gpus(1).obj()
    secret["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    other = json.loads(json.dumps(secret))
    other["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["key"] = "t2"
    assert workload_fingerprint(secret, GPUS) != workload_fingerprint(other, GPUS)


def test_a_job_and_the_pods_it_creates_share_a_fingerprint() -> None:
    job = make_job("train").gpus(1).env("BATCH", "8").obj()
    pod = make_pod("train-x").owned_by("Job", "train").gpus(1).env("BATCH", "8").obj()
    assert workload_fingerprint(job, GPUS) == workload_fingerprint(pod, GPUS)


@pytest.mark.parametrize("backend", ["HAMi", "Volcano", "GPUShare", "KAI", "MIGMixed", "MIGSingle"])
def test_the_webhook_rewrite_never_changes_the_fingerprint(backend: str) -> None:
    webhook = LocalWebhook(make_policy(backend, GPUS))
    job = make_pytorchjob("ddp").opt_in().gpus(1).obj()
    webhook.record(EstimateRecord.from_dict(
        record_dict(workload_fingerprint(job, GPUS), {"A100-80GB": 9.0, "H100-80GB": 9.0})))
    patched = webhook.send(review(job)).patched()
    assert patched != job
    assert workload_fingerprint(patched, GPUS) == workload_fingerprint(job, GPUS)


def _settings(**spec: Any) -> Any:
    return make_policy("HAMi", ("A100-80GB",), **spec).for_namespace("ml")


@pytest.mark.parametrize(
    "estimate, spec, expected",
    [
        (10 * GiB, {}, 10752 * MiB),  # 10.5 GiB exactly: already a multiple of 256 MiB
        (10 * GiB + 1, {}, 11008 * MiB),  # a byte over 10.5 GiB: up to the next 256 MiB
        (10 * GiB, {"safetyMarginPercent": 0, "granularity": "1Mi"}, 10 * GiB),
        (10 * GiB, {"overcommitPercent": 20, "safetyMarginPercent": 0, "granularity": "1Mi"}, 8 * GiB),
        (100 * MiB, {}, 1 * GiB),  # the minimum request
        (78 * GiB, {}, 84970559242),  # never above the A100-80GB's capacity
    ],
)
def test_requests_are_sized_with_margin_overcommit_minimum_rounding_and_capacity(
    estimate: int, spec: Any, expected: int
) -> None:
    settings = _settings(**spec)
    capacity = settings.targets[0].gpu.capacity_bytes
    assert sizing.size_request(estimate, settings, capacity) == expected


def test_the_floor_for_hand_set_requests_is_the_estimate_less_the_overcommit() -> None:
    assert sizing.floor_bytes(10 * GiB, _settings()) == 10 * GiB
    assert sizing.floor_bytes(10 * GiB, _settings(overcommitPercent=10)) == 9 * GiB
