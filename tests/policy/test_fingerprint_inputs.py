"""The fingerprint holds the versions of the ConfigMaps a GPU container mounts or reads, so an
edited script in a ConfigMap is a different program to estimate."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Tuple

from tests.controller.support import training_job
from xmem_admission.cluster.integrations import estimation_units, for_kind
from xmem_admission.cluster.integrations import fingerprint_of as workload_fingerprint
from xmem_admission.cluster.policy import fingerprint

GPUS = ("A100-80GB", "H100-80GB")
JOB = for_kind("batch", "v1", "Job")


class Versions:
    """A namespace's ConfigMaps as a cache would give them: name -> (uid, resourceVersion)."""

    def __init__(self, **found: Tuple[str, str]) -> None:
        self.found = dict(found)
        self.asked: list = []

    def __call__(self, kind: str, name: str) -> Optional[Tuple[str, str]]:
        self.asked.append((kind, name))
        return self.found.get(name) if kind == "ConfigMap" else None


def fp(obj: Dict[str, Any], versions: Optional[Versions]) -> str:
    assert JOB is not None
    return workload_fingerprint(JOB, obj, GPUS, versions=versions)


def test_editing_the_mounted_config_map_changes_the_fingerprint_and_nothing_else_does() -> None:
    job = training_job("train")  # mounts ConfigMap "code" at /app
    before = fp(job, Versions(code=("uid-1", "100")))
    assert fp(job, Versions(code=("uid-1", "100"))) == before
    assert fp(job, Versions(code=("uid-1", "101"))) != before  # edited
    assert fp(job, Versions(code=("uid-2", "100"))) != before  # deleted and made again
    assert fp(job, Versions(code=("uid-1", "100"), other=("uid-9", "7"))) == before


def test_without_a_lookup_the_fingerprint_is_what_it_always_was() -> None:
    job = training_job("train")
    assert fp(job, None) == fingerprint.of_templates([job["spec"]["template"]], GPUS)
    assert fp(job, None) != fp(job, Versions(code=("uid-1", "100")))


def test_a_config_map_not_in_the_cache_counts_by_name() -> None:
    job = training_job("train")
    missing = fp(job, Versions())
    assert missing != fp(job, None) and missing != fp(job, Versions(code=("u", "1")))


def test_env_from_value_from_and_projected_volumes_count_and_other_containers_do_not() -> None:
    job = training_job("train")
    spec = job["spec"]["template"]["spec"]
    gpu = spec["containers"][0]
    gpu["envFrom"] = [{"configMapRef": {"name": "settings"}}, {"secretRef": {"name": "token"}}]
    gpu["env"] = [{"name": "LR", "valueFrom": {"configMapKeyRef": {"name": "tuning",
                                                                    "key": "lr"}}}]
    spec["volumes"].append({"name": "both", "projected": {"sources": [
        {"configMap": {"name": "extra"}}, {"secret": {"name": "creds"}}]}})
    spec["volumes"].append({"name": "unmounted", "configMap": {"name": "unused"}})
    gpu["volumeMounts"].append({"name": "both", "mountPath": "/both"})
    spec["containers"].append({"name": "sidecar", "image": "busybox",
                               "envFrom": [{"configMapRef": {"name": "sidecar-only"}}]})
    versions = Versions()
    fp(job, versions)
    assert sorted({name for _kind, name in versions.asked}) == [
        "code", "extra", "settings", "tuning"]
    assert {kind for kind, _name in versions.asked} == {"ConfigMap"}
    for name in ("settings", "tuning", "extra"):
        assert fp(job, Versions(**{name: ("u", "2")})) != fp(job, Versions(**{name: ("u", "1")}))
    assert fp(job, Versions(unused=("u", "2"))) == fp(job, Versions(unused=("u", "1")))


def test_malformed_references_are_read_without_an_error() -> None:
    job = training_job("train")
    spec = job["spec"]["template"]["spec"]
    spec["volumes"] = [{"name": "code", "configMap": "not-an-object"}, "junk",
                       {"name": "p", "projected": {"sources": "junk"}}]
    spec["containers"][0]["envFrom"] = ["junk", {"configMapRef": {"name": 7}}]
    spec["containers"][0]["env"] = [{"name": "X", "valueFrom": "junk"}]
    spec["containers"][0]["volumeMounts"] = [{"name": None}, "junk", {"name": "code"}]
    assert len(fp(job, Versions(code=("u", "1")))) == fingerprint.DIGEST_CHARS


def test_estimation_units_read_the_same_versions() -> None:
    assert JOB is not None
    job = training_job("train")
    versions = Versions(code=("uid-1", "100"))
    [unit] = estimation_units(JOB, copy.deepcopy(job), GPUS, versions)
    assert unit.fingerprint == fp(job, versions)
