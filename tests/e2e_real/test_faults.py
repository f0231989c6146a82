"""Faults on the real control plane: the controller killed at each step, two replicas with real
Lease election, the API server restarted mid-reconcile, a webhook that is down, answers a healthy
server never gives (429, 500, through the fault proxy), and concurrent writers.

Whatever happens, each held Job ends up released with one estimate, and no Job stays held."""

from __future__ import annotations

import json
import threading

import pytest
import yaml
from kubernetes import client

from localkube.cluster import LEASE, NAMESPACE
from localkube.controlplane import kubeconfig, wait_for
from localkube.faultproxy import FaultProxy
from tests.e2e_real.support import QUICK_LEASE, job, template_annotations
from xmem_admission.cluster import labels


def _submit(xmem, name):
    batch = client.BatchV1Api(xmem.cluster.api)
    created = batch.create_namespaced_job(xmem.namespace, job(name, xmem.namespace),
                                          _preload_content=False)
    obj = json.loads(created.data)
    assert obj["spec"]["suspend"] is True
    return obj


def _released_once(xmem, name):
    released = xmem.wait_released(name)
    gmes = xmem.gmes()
    assert len(gmes) == 1, [g["metadata"]["name"] for g in gmes]
    assert gmes[0]["status"]["phase"] == "Succeeded", gmes[0]["status"]
    assert released["spec"]["suspend"] is False
    assert int(template_annotations(released)[labels.REQUEST_BYTES]) > 0
    return released


def _gme_step(xmem):
    gmes = xmem.gmes()
    return bool(gmes)


def _pod_step(xmem):
    return bool(xmem.estimation_pods())


def _recorded_step(xmem):
    return any((g.get("status") or {}).get("phase") == "Succeeded" for g in xmem.gmes())


STEPS = {"estimate-recorded-as-object": _gme_step, "estimation-pod-created": _pod_step,
         "result-recorded": _recorded_step}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_controller_killed_at_each_step_is_finished_by_a_new_process(xmem, step):
    xmem.serve()
    first = xmem.controller("", "--no-leader-election")
    _submit(xmem, "train")
    wait_for(lambda: STEPS[step](xmem), 120, f"the controller to reach {step}", interval=0.05)
    xmem.cluster.stop_process(first, kill=True)
    xmem.controller("", "--no-leader-election")
    _released_once(xmem, "train")
    [gme] = xmem.gmes()
    assert gme["status"].get("attempt", 1) == 1  # one pod a name per attempt


def test_two_replicas_elect_one_leader_and_the_standby_finishes_when_it_dies(xmem):
    cluster = xmem.cluster
    xmem.serve()
    coordination = client.CoordinationV1Api(cluster.api)
    first = xmem.controller(f"{xmem.namespace}-a", *QUICK_LEASE)
    second = xmem.controller(f"{xmem.namespace}-b", *QUICK_LEASE)

    def holder():
        try:
            lease = coordination.read_namespaced_lease(LEASE, NAMESPACE)
        except client.ApiException:
            return None
        identity = lease.spec.holder_identity
        return identity if identity in (f"{xmem.namespace}-a", f"{xmem.namespace}-b") else None

    leader = wait_for(holder, 60, "one replica to take the Lease")
    _submit(xmem, "train")
    wait_for(lambda: xmem.estimation_pods(), 120, "the leader to start estimating")
    dying, surviving = (first, second) if leader.endswith("-a") else (second, first)
    cluster.stop_process(dying, kill=True)
    new_leader = wait_for(lambda: (lambda h: h if h and h != leader else None)(holder()), 60,
                          "the standby to take the Lease over")
    assert new_leader != leader
    _released_once(xmem, "train")
    assert surviving.poll() is None


def test_the_api_server_restarted_mid_reconcile_loses_nothing(xmem):
    cluster = xmem.cluster
    xmem.serve()
    xmem.controller("", "--no-leader-election")
    _submit(xmem, "train")
    wait_for(lambda: xmem.estimation_pods(), 120, "the estimation pod")
    cluster.plane.restart_apiserver()
    cluster.invalidate_discovery()
    _released_once(xmem, "train")


def test_a_webhook_that_is_down_fails_open_as_the_chart_sets_it_or_closed_when_told(xmem):
    cluster = xmem.cluster
    webhook = xmem.serve()
    webhook.stop()  # the configurations still point at it
    batch = client.BatchV1Api(cluster.api)
    admitted = batch.create_namespaced_job(xmem.namespace, job("open", xmem.namespace))
    assert not admitted.spec.suspend  # failurePolicy: Ignore (the chart's default)
    assert labels.HELD_REASON not in (admitted.metadata.annotations or {})

    webhook.configure({"webhook": {"failurePolicy": "Fail"}})
    with pytest.raises(client.ApiException) as refused:
        batch.create_namespaced_job(xmem.namespace, job("closed", xmem.namespace))
    assert refused.value.status == 500
    message = json.loads(refused.value.body)["message"]
    assert 'failed calling webhook "object.mutate.xmem.io"' in message
    assert "connection refused" in message


def test_429_and_500_answers_on_the_controllers_writes_still_end_in_one_release(xmem):
    cluster = xmem.cluster
    proxy = FaultProxy(cluster.plane.port, str(cluster.plane._authority().cert_file)).start()
    try:
        config = yaml.safe_load(cluster.controller_kubeconfig.read_text())
        through = kubeconfig(cluster.root / f"{xmem.namespace}-proxy.kubeconfig", proxy.url,
                             cluster.plane._authority().cert_file, "controller-via-proxy",
                             token=config["users"][0]["user"]["token"])
        ns = xmem.namespace
        proxy.inject("POST", rf"/namespaces/{ns}/gpumemoryestimates", 429, times=2)
        proxy.inject("POST", rf"/namespaces/{ns}/pods$", 500, times=1)
        proxy.inject("PUT", rf"/namespaces/{ns}/jobs/train$", 500, times=1)
        proxy.inject("PUT", rf"/namespaces/{ns}/jobs/train$", 429, times=1)
        xmem.serve()
        xmem.controller("", "--no-leader-election", kubeconfig=through)
        _submit(xmem, "train")
        _released_once(xmem, "train")
        injected = {(m, s) for m, _, s in proxy.injected()}
        assert injected == {("POST", 429), ("POST", 500), ("PUT", 500), ("PUT", 429)}, \
            proxy.injected()
        [gme] = xmem.gmes()
        assert gme["status"].get("attempt", 1) == 1  # one pod a name per attempt
        wait_for(lambda: not xmem.estimation_pods(), 30, "the succeeded pod to be deleted")
    finally:
        proxy.stop()


def test_a_concurrent_writer_editing_the_held_job_does_not_lose_the_release(xmem):
    cluster = xmem.cluster
    xmem.serve()
    _submit(xmem, "train")
    batch = client.BatchV1Api(cluster.api)
    stop = threading.Event()
    writes = []

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            try:
                batch.patch_namespaced_job("train", xmem.namespace,
                                           {"metadata": {"labels": {"edited": str(i)}}})
                writes.append(i)
            except client.ApiException:
                pass
            stop.wait(0.05)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        xmem.controller("", "--no-leader-election")
        released = _released_once(xmem, "train")
    finally:
        stop.set()
        thread.join(5)
    assert len(writes) > 10
    final = xmem.job("train")
    assert final["metadata"]["labels"]["edited"] == str(writes[-1])
    assert final["spec"]["suspend"] is False
    assert template_annotations(final) == template_annotations(released)
