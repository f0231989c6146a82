"""A GPUMemoryEstimate an older release wrote spells its values in lower case (``mode: fake``,
``runs[].source: hami``/``dcgm``). A cluster upgraded in place keeps those objects: the
controller reads them as before and writes back only the API's PascalCase spelling, which the
CRD's schema accepts (its enums list only that)."""

from __future__ import annotations

from pathlib import Path

from tests.support.builders import make_job
from tests.support.estimates import record_for
from tests.support.schemas import crd_validator, validate_custom
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.policy import overhead

GME_CRD = Path(__file__).resolve().parents[2] / "helm" / "xmem-admission" / "crds" / \
    "gpumemoryestimates.xmem.io.yaml"
GIB = 1 << 30
GPU = "A100-80GB"


def _run(uid: str, source: str, peak_gib: int) -> dict:
    return {"workload": {"kind": "Job", "name": uid, "uid": uid}, "gpu": GPU,
            "estimateBytes": 20 * GIB, "requestBytes": 22 * GIB, "completed": True,
            "finished": f"2026-01-31T12:0{peak_gib % 10}:00Z", "pods": 1,
            "observedPeakBytes": peak_gib * GIB, "source": source, "series": 1}


def _older_gme() -> dict:
    job = make_job("train", "ml").opt_in().gpus(1).obj()
    gme = records.from_record(record_for(job, {GPU: 20}, [GPU]), "ml")
    gme["status"].update(mode="fake", runs=[_run("u-1", "hami", 21), _run("u-2", "dcgm", 23)])
    return gme


def test_an_older_estimates_lower_case_runs_are_read_as_before():
    gme = _older_gme()
    found = records.record(gme)
    assert found is not None
    assert sorted(r.peak_bytes for r in found.runs) == [21 * GIB, 23 * GIB]
    assert [e["source"] for e in records.run_entries(gme)] == ["hami", "dcgm"]


def test_a_run_added_to_an_older_estimate_rewrites_its_runs_in_the_apis_spelling():
    gme = _older_gme()
    status = records.with_run(gme["status"], _run("u-3", "HAMi", 22))
    assert [e["source"] for e in status["runs"]] == ["HAMi", "DCGM", "HAMi"]
    assert [e["observedPeakBytes"] for e in status["runs"]] == [21 * GIB, 23 * GIB, 22 * GIB]
    status["mode"] = records.mode_name(status["mode"])
    validate_custom(dict(gme, status=status), GME_CRD)


def test_the_schema_refuses_the_older_spelling_in_a_new_write():
    errors = {".".join(map(str, e.absolute_path)): e.message
              for e in crd_validator(str(GME_CRD)).iter_errors(_older_gme())}
    assert errors == {"status.mode": "'fake' is not one of ['Fake', 'Profile']",
                      "status.runs.0.source": "'hami' is not one of ['HAMi', 'DCGM']",
                      "status.runs.1.source": "'dcgm' is not one of ['HAMi', 'DCGM']"}


def test_the_probe_mode_either_spelling_is_recorded_in_the_apis():
    assert [records.mode_name(w) for w in ("fake", "profile", "Fake", "Profile")] == \
        ["Fake", "Profile", "Fake", "Profile"]
    assert [records.run_source(s) for s in ("hami", "dcgm", "HAMi", "DCGM")] == \
        ["HAMi", "DCGM", "HAMi", "DCGM"]


def test_the_overhead_source_and_column_keep_their_spellings():
    pinned = overhead.Applied(GPU, overhead.PINNED, 900 << 20, 300 << 20, 600 << 20)
    assert pinned.status()["source"] == "Pinned" and pinned.column() == "+600Mi pinned"
    learned = overhead.Applied(GPU, overhead.LEARNED, 800 << 20, 300 << 20, 500 << 20, jobs=7,
                               driver="580.95.05")
    assert learned.status()["source"] == "Learned" and learned.column() == "+500Mi learned/7"
    catalogue = overhead.Applied(GPU, overhead.CATALOGUE, 300 << 20, 300 << 20, 0)
    assert catalogue.status()["source"] == "Catalogue" and catalogue.column() == "+0Mi catalogue"
