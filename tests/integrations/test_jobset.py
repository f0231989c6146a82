"""JobSet (jobset.x-k8s.io/v1alpha2): its pod templates, how it is held, its world, and the
parts of other workloads (a TrainJob's JobSet, a JobSet's Jobs) that pass unchanged."""

from __future__ import annotations

from tests.support.builders import make_job, make_jobset, review
from tests.support.estimates import record_for
from tests.support.harness import HttpsWebhook
from xmem_admission.cluster import labels
from xmem_admission.cluster.admission.trust import DEFAULT_WORKLOAD_CONTROLLERS
from xmem_admission.cluster.integrations import for_kind, part_of_held_workload
from xmem_admission.cluster.integrations.jobset import JobSetIntegration

GPUS = ("A100-80GB", "H100-80GB")
ESTIMATE = {"A100-80GB": 11.7, "H100-80GB": 11.9}
JOBSET = JobSetIntegration()
TRAINER = "system:serviceaccount:kubeflow-system:kubeflow-trainer-controller-manager"
JOBSET_CONTROLLER = "system:serviceaccount:jobset-system:jobset-controller-manager"


def test_the_webhook_finds_the_jobset_integration_by_its_group_version_and_kind() -> None:
    found = for_kind("jobset.x-k8s.io", "v1alpha2", "JobSet")
    assert found is not None and found.kind == "JobSet" and found.can_hold
    assert found.resource.plural == "jobsets"


def test_each_replicated_job_is_a_pod_template_named_after_it() -> None:
    jobset = make_jobset("ddp", roles=("leader", "workers")).obj()
    refs = JOBSET.pod_templates(jobset)
    assert [r.role for r in refs] == ["leader", "workers"]
    assert refs[1].path == ("spec", "replicatedJobs", 1, "template", "spec", "template")
    assert refs[1].template is jobset["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]


def test_a_jobset_without_replicated_jobs_is_an_error_that_names_the_field() -> None:
    jobset = make_jobset("empty").obj()
    jobset["spec"]["replicatedJobs"] = []
    try:
        JOBSET.pod_templates(jobset)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        assert "spec.replicatedJobs" in str(exc)
    else:
        raise AssertionError("no error")


def test_the_world_is_replicas_times_parallelism_over_the_gpu_replicated_jobs() -> None:
    jobset = make_jobset("ddp").gpus(2).replicas("workers", 3, parallelism=2).obj()
    env = JOBSET.rank0_environment(jobset)
    # leader: 1 x 1 pod, workers: 3 x 2 pods; 2 GPUs each: 7 nodes of 2 processes
    assert env["PET_NNODES"] == "7" and env["PET_NPROC_PER_NODE"] == "2"
    assert env["WORLD_SIZE"] == "14" and env["RANK"] == "0" and env["PET_NODE_RANK"] == "0"


def test_a_jobset_of_one_gpu_pod_is_not_given_a_distributed_world() -> None:
    jobset = make_jobset("single", roles=("trainer",)).gpus(1).obj()
    assert JOBSET.rank0_environment(jobset) == {}


def test_replicated_jobs_without_gpus_do_not_count_in_the_world() -> None:
    jobset = make_jobset("ddp", roles=("data", "workers")).obj()
    workers = jobset["spec"]["replicatedJobs"][1]
    workers["replicas"] = 4
    workers["template"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] = "1"
    jobset["spec"]["replicatedJobs"][0]["replicas"] = 9
    assert JOBSET.rank0_environment(jobset)["PET_NNODES"] == "4"


def test_completed_and_failed_are_read_from_the_jobset_conditions() -> None:
    jobset = make_jobset("ddp").obj()
    assert JOBSET.finished(jobset) is None
    jobset["status"] = {"conditions": [{"type": "Completed", "status": "True"}]}
    assert JOBSET.finished(jobset) is True
    jobset["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    assert JOBSET.finished(jobset) is False


def test_a_jobset_without_an_estimate_is_held_with_spec_suspend(served: HttpsWebhook) -> None:
    jobset = make_jobset("ddp").opt_in().gpus(1).obj()
    answer = served.send(review(jobset))
    patched = answer.patched()
    assert patched["spec"]["suspend"] is True
    assert patched["metadata"]["annotations"][labels.HELD_REASON]
    assert all(j["template"]["spec"]["template"]["metadata"]["labels"][labels.OPT_IN] == "true"
               for j in patched["spec"]["replicatedJobs"])
    assert served.send(review(patched)).ops == []


def test_a_jobset_with_an_estimate_is_sized_in_every_replicated_job(served: HttpsWebhook) -> None:
    jobset = make_jobset("ddp").opt_in().gpus(1).obj()
    served.record(record_for(jobset, ESTIMATE, GPUS))
    patched = served.send(review(jobset)).patched()
    assert not patched["spec"].get("suspend")
    for job in patched["spec"]["replicatedJobs"]:
        template = job["template"]["spec"]["template"]
        assert template["metadata"]["annotations"][labels.REQUEST_BYTES]
        assert template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"]
    assert served.send(review(patched)).ops == []


def test_jobset_and_trainer_controllers_are_trusted_workload_controllers() -> None:
    assert TRAINER in DEFAULT_WORKLOAD_CONTROLLERS
    assert JOBSET_CONTROLLER in DEFAULT_WORKLOAD_CONTROLLERS


def test_a_jobset_a_trainjob_made_passes_unchanged(served: HttpsWebhook) -> None:
    jobset = make_jobset("ddp").opt_in().gpus(1).owned_by(
        "TrainJob", "ddp", "trainer.kubeflow.org/v1alpha1").obj()
    assert part_of_held_workload(jobset) == "TrainJob"
    answer = served.send(review(jobset, user=TRAINER))
    assert answer.allowed and answer.ops == [] and answer.warnings == []
    checked = served.send(review(jobset, user=TRAINER), endpoint="validate")
    assert checked.allowed and checked.warnings == []


def test_a_tenant_cannot_pass_a_jobset_off_as_a_trainjob_part(served: HttpsWebhook) -> None:
    jobset = make_jobset("ddp").opt_in().gpus(1).owned_by(
        "TrainJob", "ddp", "trainer.kubeflow.org/v1alpha1").obj()
    patched = served.send(review(jobset, user="alice")).patched()
    assert patched["spec"]["suspend"] is True


def test_the_jobs_of_a_sized_jobset_keep_their_sizing_annotations(served: HttpsWebhook) -> None:
    """The JobSet controller copies the sized template into each Job: the webhook must neither
    strip the annotations (a Job's are believed only from the xmem controller) nor hold it."""
    builder = make_job("ddp-workers-0").opt_in().gpus(1)
    builder.template_annotation(labels.REQUEST_BYTES, str(12800 << 20))
    builder.template_annotation(labels.ESTIMATE_BYTES, str(int(11.7 * (1 << 30))))
    job = builder.obj()
    job["metadata"]["ownerReferences"] = [{
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "ddp",
        "uid": "5b0c6a3e-2222-4333-8444-555566667777", "controller": True}]
    answer = served.send(review(job, user=JOBSET_CONTROLLER))
    assert answer.allowed and answer.ops == []


def test_a_job_owned_by_something_xmem_does_not_hold_is_judged_as_its_own(
        served: HttpsWebhook) -> None:
    job = make_job("nightly-123").opt_in().gpus(1).obj()
    job["metadata"]["ownerReferences"] = [{
        "apiVersion": "batch/v1", "kind": "CronJob", "name": "nightly", "uid": "u-1",
        "controller": True}]
    assert part_of_held_workload(job) is None
    patched = served.send(review(job, user="system:serviceaccount:kube-system:cronjob-controller"))\
        .patched()
    assert patched["spec"]["suspend"] is True


def test_the_world_is_part_of_a_jobsets_fingerprint_so_a_job_never_shares_its_estimate() -> None:
    from tests.support.estimates import workload_fingerprint

    one = make_jobset("one", roles=("trainer",)).gpus(1).obj()
    many = make_jobset("many", roles=("trainer",)).gpus(1).replicas("trainer", 4, 4).obj()
    job = make_job("train").gpus(1).obj()
    assert workload_fingerprint(one, GPUS) == workload_fingerprint(job, GPUS)
    assert workload_fingerprint(many, GPUS) != workload_fingerprint(one, GPUS)


def test_identical_replicated_jobs_are_one_estimate_under_the_jobsets_fingerprint() -> None:
    from tests.support.estimates import workload_fingerprint
    from xmem_admission.cluster.integrations import estimation_units

    jobset = make_jobset("ddp").gpus(1).replicas("workers", 3).obj()
    (unit,) = estimation_units(JOBSET, jobset, GPUS)
    assert unit.fingerprint == workload_fingerprint(jobset, GPUS) and unit.templates == (0, 1)


def two_programs() -> dict:
    jobset = make_jobset("rl", roles=("actor", "learner")).gpus(1) \
        .replicas("learner", 2).image_of("learner", "ghcr.io/acme/learner:2.0").obj()
    return jobset


def test_replicated_jobs_of_different_images_are_each_their_own_estimate() -> None:
    from tests.support.estimates import workload_fingerprint
    from xmem_admission.cluster.integrations import estimation_units

    jobset = two_programs()
    actor, learner = estimation_units(JOBSET, jobset, GPUS)
    assert (actor.templates, learner.templates) == ((0,), (1,))
    # the actor alone is one pod: the fingerprint of a Job running its template
    alone = make_job("actor").gpus(1).obj()
    assert actor.fingerprint == workload_fingerprint(alone, GPUS)
    # the learner runs in its own world of 2 pods
    assert JOBSET.unit_environment(jobset, ["learner"])["PET_NNODES"] == "2"
    assert learner.fingerprint not in (actor.fingerprint, workload_fingerprint(jobset, GPUS))


def record_of(fp: str, total_gib: float) -> object:
    from tests.support.estimates import record_dict
    from xmem_admission.cluster.policy.store import EstimateRecord

    return EstimateRecord.from_dict(record_dict(fp, {"A100-80GB": total_gib,
                                                     "H100-80GB": total_gib}))


def test_each_replicated_job_is_sized_from_its_own_programs_estimate(served: HttpsWebhook) -> None:
    from xmem_admission.cluster.integrations import estimation_units

    jobset = two_programs()
    jobset["metadata"]["labels"] = {labels.OPT_IN: labels.OPT_IN_VALUE}
    actor, learner = estimation_units(JOBSET, jobset, GPUS)
    served.record(record_of(actor.fingerprint, 6.0), record_of(learner.fingerprint, 30.0))
    patched = served.send(review(jobset)).patched()
    assert not patched["spec"].get("suspend")
    requests = [int(j["template"]["spec"]["template"]["metadata"]["annotations"][
        labels.REQUEST_BYTES]) for j in patched["spec"]["replicatedJobs"]]
    assert requests[0] < 8 << 30 < 30 << 30 < requests[1]
    assert served.send(review(patched)).ops == []
    checked = served.send(review(patched), endpoint="validate")
    assert checked.allowed and checked.warnings == []


def test_a_jobset_is_held_until_every_program_has_an_estimate(served: HttpsWebhook) -> None:
    from xmem_admission.cluster.integrations import estimation_units

    jobset = two_programs()
    jobset["metadata"]["labels"] = {labels.OPT_IN: labels.OPT_IN_VALUE}
    actor, _learner = estimation_units(JOBSET, jobset, GPUS)
    served.record(record_of(actor.fingerprint, 6.0))
    patched = served.send(review(jobset)).patched()
    assert patched["spec"]["suspend"] is True
    assert all(labels.REQUEST_BYTES not in (j["template"]["spec"]["template"]["metadata"]
                                            .get("annotations") or {})
               for j in patched["spec"]["replicatedJobs"])
