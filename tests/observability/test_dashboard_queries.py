"""The Grafana dashboard and the recording rules against a real Prometheus on loopback.

Prometheus (Debian's build, installed by scripts/install-tools.sh) scrapes:
- a running `xmem serve` (the real CLI in its own process, started with examples/policy.yaml, a
  certificate made by the chart's certgen script, and recorded estimates), to which the test
  sends real AdmissionReviews over HTTPS all along: Jobs with and without estimates, a bare Pod
  that carries its request, a Job without GPU;
- exporter scrapes served as static targets (tests/data/scrapes, written for this test in the
  exporters' formats, see its README): DCGM exporter, HAMi, kube-state-metrics.
- a running `xmem controller` (the real CLI, in its own process) working against the session's
  real control plane (kube-apiserver, and the project's node that runs pods as local processes):
  it estimates two held Jobs, one a real training script (succeeds), one a script that exits with
  an error.
It evaluates the chart's own rules (rendered by helm). Every query of every panel must parse and
return data.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import httpx
import jsonschema
import pytest
import yaml

from localkube.controlplane import free_port as _free_port
from localkube.controlplane import wait_while_running
from tests.helm.chart import CHART, ROOT, run, tool
from tests.observability.rules import write_rule_file
from tests.support.builders import make_job, make_pod, review
from tests.support.estimates import record_dict, workload_fingerprint
from xmem_admission.cluster import labels

DASHBOARD = CHART / "files" / "dashboards" / "xmem-admission.json"
DASHBOARD_SCHEMA = ROOT / "tests" / "data" / "schemas" / "grafana-dashboard.jsonschema.json"
SCRAPES = ROOT / "tests" / "data" / "scrapes"
POLICY = ROOT / "examples" / "policy.yaml"
GPUS = ("A100-80GB", "H100-80GB")  # the targets of examples/policy.yaml, in its order
GiB = 1 << 30
# Grafana's built-in variables and the dashboard's own, as Grafana would substitute them.
# Windows span the whole test, so an estimation that ended before a scrape still shows.
SUBSTITUTIONS = {"$__rate_interval": "5m", "$__range": "5m", "$namespace": ".*",
                 "$workload": ".*", "${datasource}": "prometheus"}
NAMESPACE = "obs-nlp"  # the controller's two held Jobs, on the real control plane


def _dashboard() -> Dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _queries() -> List[Tuple[str, str]]:
    """(panel title / refId, PromQL as Grafana sends it) for every target of every panel."""
    out = []
    for panel in _panels(_dashboard()):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in SUBSTITUTIONS.items():
                expr = expr.replace(variable, value)
            out.append((f"{panel['title']} / {target['refId']}", expr))
    return out


def _metric_names(expr: str) -> Set[str]:
    names = set(re.findall(r"\b((?:xmem|DCGM|hami|kube)[a-zA-Z0-9_:]*)\s*[\[{)]", expr))
    names |= set(re.findall(r"\b((?:xmem|DCGM|hami|kube)[a-zA-Z0-9_:]*)\s*$", expr))
    return names


def test_dashboard_validates_against_grafanas_published_schema() -> None:
    schema = json.loads(DASHBOARD_SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(_dashboard()))
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]]


def test_dashboard_panels_cover_what_sres_asked_for() -> None:
    titles = " | ".join(p["title"].lower() for p in _panels(_dashboard()))
    for topic in ("request vs actual", "error distribution", "freed vs whole-gpu",
                  "admission latency", "estimation duration", "estimations by result",
                  "held workloads", "memory outside the allocator"):
        assert topic in titles, topic
    exprs = " ".join(expr for _, expr in _queries())
    # Actual use comes from the recording rules, which read DCGM or HAMi (tested below).
    assert "xmem:workload_gpu_memory_used_bytes" in exprs
    # the learned memory outside the allocator, per GPU model and driver
    assert "by (gpu_model, driver_version) (xmem_controller_learned_overhead_bytes)" in exprs
    ids = [p["id"] for p in _panels(_dashboard())]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_the_chart_ships_the_dashboard_in_a_configmap_grafana_picks_up() -> None:
    from tests.helm.chart import one, render

    configmap = one(render({}), "ConfigMap", "xmem-xmem-admission-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["xmem-admission.json"]) == _dashboard()


class _Scrapes(BaseHTTPRequestHandler):
    """Serves tests/data/scrapes/<name>.prom at /<name>, as an exporter would."""

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = SCRAPES / (self.path.strip("/") + ".prom")
        if not path.is_file():
            self.send_error(404)
            return
        body = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


def _workloads() -> List[Dict[str, Any]]:
    resnet = make_job("resnet", "ml-team").opt_in().gpus(1).obj()
    llama = make_job("llama", "ml-team").opt_in().gpus(1).image("ghcr.io/acme/llama:2").obj()
    bert = make_job("bert", "nlp").opt_in().gpus(1).image("ghcr.io/acme/bert:1").obj()
    cpu = make_job("preprocess", "ml-team").opt_in().obj()
    notebook = make_pod("notebook-gpu", "research").opt_in().gpus(1).obj()  # a bare Pod, on HAMi
    return [resnet, llama, bert, cpu, notebook]


def _held(obj: Dict[str, Any]) -> Dict[str, Any]:
    """The Job as the webhook leaves it (held), held since now."""
    from datetime import datetime, timezone

    from tests.support.harness import LocalWebhook
    from xmem_admission.cluster.policy.model import Policy

    held = LocalWebhook(Policy.from_file(str(POLICY))).send(review(obj), "mutate", "object")
    job = held.patched()
    assert job["spec"]["suspend"] is True
    job["metadata"]["annotations"][labels.HELD_SINCE] = datetime.now(timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    return job


def _hold_two_jobs(cluster: Any) -> None:
    """Two held Jobs on the session's real control plane, for `xmem controller` to estimate
    (its estimation pods run on the process node): one that traces, one whose script fails."""
    from kubernetes import client

    api = cluster.plane.api_client()
    gpt = make_job("gpt-small", NAMESPACE).opt_in().gpus(1).obj()
    gpt["spec"]["template"]["spec"]["containers"][0]["command"] = [
        "python", str(ROOT / "examples" / "train_gpt.py"), "--layers", "2", "--hidden", "128",
        "--heads", "4", "--vocab", "1000", "--seq-len", "64", "--batch-size", "2"]
    broken = make_job("broken-script", NAMESPACE).opt_in().gpus(1).obj()
    broken["spec"]["template"]["spec"]["containers"][0]["command"] = [
        "python", "-c", "raise SystemExit('cannot open the data set')"]
    for job in (gpt, broken):
        client.BatchV1Api(api).create_namespaced_job(NAMESPACE, _held(job))
    api.close()


def _start_controller(cluster: Any) -> Tuple[subprocess.Popen, int]:
    """`xmem controller` on the session's real control plane, nothing held yet."""
    from localkube.cluster import PROBE_IMAGE

    cluster.ensure_namespace(NAMESPACE)
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "xmem_admission.cli", "controller", "--kubeconfig",
         str(cluster.plane.admin_kubeconfig), "--policy", str(POLICY), "--no-leader-election",
         "--probe-image", PROBE_IMAGE, "--host", "127.0.0.1", "--metrics-port", str(port),
         "--resync-seconds", "2", "--log-level", "warning", "--workloads", "Job"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, port


@pytest.fixture(scope="module")
def stack(tmp_path_factory, cluster) -> Iterator[Dict[str, Any]]:
    prometheus = tool("prometheus")
    work = tmp_path_factory.mktemp("observability")
    certs = work / "certs"
    run([sys.executable, str(CHART / "files" / "certgen.py"), "generate", "--namespace", "test",
         "--service", "localhost", "--out", str(certs)])
    estimates = work / "estimates"
    estimates.mkdir()
    resnet, llama, _, _, notebook = _workloads()
    for obj, gib in ((resnet, 18), (llama, 34), (notebook, 15)):
        record = record_dict(workload_fingerprint(obj, GPUS), {g: gib for g in GPUS})
        (estimates / f"{obj['metadata']['name']}.json").write_text(json.dumps(record))

    controller, controller_port = _start_controller(cluster)
    port, metrics_port = _free_port(), _free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "xmem_admission.cli", "serve", "--policy", str(POLICY),
         "--cert-file", str(certs / "tls.crt"), "--key-file", str(certs / "tls.key"),
         "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
         "--estimates", str(estimates), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    scrapes = ThreadingHTTPServer(("127.0.0.1", 0), _Scrapes)
    threading.Thread(target=scrapes.serve_forever, daemon=True).start()
    prom_port = _free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(write_rule_file(work))],
        "scrape_configs": [
            {"job_name": "xmem", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]},
            {"job_name": "xmem-controller",
             "static_configs": [{"targets": [f"127.0.0.1:{controller_port}"]}]},
        ] + [
            {"job_name": name, "metrics_path": f"/{name}", "honor_labels": True,
             "static_configs": [{"targets": [f"127.0.0.1:{scrapes.server_port}"]}]}
            for name in ("dcgm-exporter", "hami-vgpu", "kube-state-metrics")
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom = subprocess.Popen(
        [prometheus, f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
         "--log.level=warn"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()
    client = httpx.Client(base_url=f"https://localhost:{port}", timeout=10,
                          verify=ssl.create_default_context(cafile=str(certs / "ca.crt")))
    answers: Dict[str, Dict[str, Any]] = {}
    sender: Optional[threading.Thread] = None
    try:
        wait_while_running(lambda: httpx.get(f"http://127.0.0.1:{metrics_port}/readyz").status_code == 200,
                  "xmem serve ready", serve)

        def admit_forever() -> None:
            # Admission traffic during the whole test, so rates and latency quantiles exist.
            while not stop.is_set():
                for obj in _workloads():
                    reply = client.post("/mutate/object", json=review(obj, uid=str(uuid.uuid4())))
                    answers[obj["metadata"]["name"]] = reply.json()["response"]
                    if stop.wait(0.05):
                        return

        sender = threading.Thread(target=admit_forever, daemon=True)
        sender.start()
        api = httpx.Client(base_url=f"http://127.0.0.1:{prom_port}/api/v1", timeout=10)
        wait_while_running(lambda: _ready(prom_port), "Prometheus ready", prom)
        # Rules evaluated over the scrapes, with enough samples for 20 s rate windows.
        wait_while_running(lambda: bool(_query(api, "xmem:workload_gpu_memory_saved_bytes")),
                  "recording rules over the scrapes", prom)
        # rate() needs two samples of a series with an increase between them: Prometheus scrapes
        # the controller's histogram before any estimation ends (its count 0), so the
        # estimations' durations are an increase however long a loaded machine takes to start
        # Prometheus (a counter first scraped after both ended would never increase).
        wait_while_running(lambda: bool(_query(
            api, "xmem_controller_estimation_duration_seconds_count == 0")),
            "Prometheus scraping the controller before it estimates", controller)
        _hold_two_jobs(cluster)
        # Both estimations ended (a real probe run takes some seconds) and were scraped.
        wait_while_running(lambda: bool(_query(api, "xmem_controller_estimations_succeeded_total > 0"))
                  and bool(_query(api, "xmem_controller_estimations_failed_total > 0")),
                  "the controller's estimations", controller, timeout=150)
        # What each histogram panel's rate() needs: an increase within its window.
        for histogram in ("xmem_controller_estimation_duration_seconds_bucket",
                          "xmem_admission_duration_seconds_bucket"):
            wait_while_running(lambda h=histogram: bool(_query(api, f"sum(rate({h}[5m])) > 0")),
                               f"an increase of {histogram} in Prometheus", prom)
        # Then every panel's query answered with a number (a panel without data fails below,
        # after this wait, with its own message).
        try:
            wait_while_running(lambda: all(_answered(api, expr) for _, expr in _queries()),
                               "every panel's query answered", prom, timeout=30, interval=1)
        except TimeoutError:
            pass
        yield {"api": api, "answers": answers}
    finally:
        stop.set()
        if sender is not None:
            sender.join(15)  # let a request in flight finish before its client closes
        client.close()
        for process in (prom, serve, controller):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        scrapes.shutdown()
        cluster.delete("v1", "Namespace", NAMESPACE)


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/-/ready").status_code == 200
    except httpx.HTTPError:
        return False


def _answered(api: httpx.Client, expr: str) -> bool:
    """The query returns at least one sample that is a number (not NaN)."""
    return any(float(r["value"][1]) == float(r["value"][1]) for r in _query(api, expr))


def _query(api: httpx.Client, expr: str) -> List[Dict[str, Any]]:
    reply = api.get("/query", params={"query": expr})
    body = reply.json()
    assert reply.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _exported(api: httpx.Client) -> Set[str]:
    return set(api.get("/label/__name__/values").json()["data"])


def test_admissions_reached_the_server_as_the_dashboard_assumes(stack) -> None:
    answers = stack["answers"]
    assert answers["resnet"]["allowed"] and answers["resnet"].get("patch")   # estimate applied
    assert answers["bert"]["allowed"] and answers["bert"].get("patch")       # held
    assert answers["preprocess"]["allowed"] and "patch" not in answers["preprocess"]
    requests = {r["metric"]["workload"]: float(r["value"][1])
                for r in _query(stack["api"], "xmem:workload_gpu_memory_request_bytes")}
    assert set(requests) == {"resnet", "llama", "notebook-gpu"}
    # Sized from the recorded estimates (18, 34 and 15 GiB) with the policy's margin.
    assert requests["resnet"] > 18 * GiB and requests["llama"] > 34 * GiB
    assert requests["notebook-gpu"] > 15 * GiB


def test_actual_use_is_joined_to_each_workload_from_dcgm_and_hami(stack) -> None:
    used = {r["metric"]["workload"]: float(r["value"][1])
            for r in _query(stack["api"], "xmem:workload_gpu_memory_used_bytes")}
    assert used == {"resnet": 30000 * 2**20, "llama": 33000 * 2**20, "notebook-gpu": 12 * GiB}
    # resnet was sized for 18 GiB plus margin and uses 29.3 GiB: the OOM-risk panel sees it.
    above = _query(stack["api"], 'xmem:workload_gpu_memory_used_bytes > on (namespace, workload) '
                                 'xmem:workload_gpu_memory_request_bytes')
    assert [r["metric"]["workload"] for r in above] == ["resnet"]


@pytest.mark.parametrize("panel, expr", _queries(), ids=[q[0] for q in _queries()])
def test_every_dashboard_query_parses_and_returns_data(stack, panel: str, expr: str) -> None:
    api = stack["api"]
    result = _query(api, expr)  # a parse error fails here, data or not
    if not result:
        missing = _metric_names(expr) - _exported(api) - _recorded_names()
        pytest.fail(f"{panel}: no data for {expr} (no series for {sorted(missing)})")
    values = [float(r["value"][1]) for r in result]
    assert not all(v != v for v in values), f"{panel}: only NaN for {expr}"


def _recorded_names() -> Set[str]:
    from tests.observability.rules import rule_groups

    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def test_metric_names_in_rules_and_dashboard_are_the_ones_xmem_defines() -> None:
    """A renamed metric must not leave a dashboard panel or an alert silently empty: every
    xmem_* name they use is registered by the webhook's or the controller's metrics."""
    from prometheus_client import CollectorRegistry

    from tests.observability.rules import rule_groups
    from xmem_admission.cluster.admission.metrics import AdmissionMetrics
    from xmem_admission.cluster.controller.metrics import ControllerMetrics

    defined: Set[str] = set()
    for cls in (AdmissionMetrics, ControllerMetrics):
        registry = CollectorRegistry()
        cls(registry=registry)
        for family in registry.collect():
            defined |= {sample.name for sample in family.samples} | {family.name}
            if family.type == "counter":
                defined.add(family.name + "_total")
            if family.type == "histogram":
                defined |= {family.name + s for s in ("_bucket", "_count", "_sum")}
    used: Set[str] = set()
    for _, expr in _queries():
        used |= _metric_names(expr)
    for group in rule_groups():
        for rule in group["rules"]:
            used |= _metric_names(rule["expr"])
    used = {n for n in used if n.startswith("xmem_")}
    assert {"xmem_admission_duration_seconds_bucket",
            "xmem_controller_estimation_duration_seconds_bucket"} <= used
    assert not used - defined, f"used but not defined: {sorted(used - defined)}"
