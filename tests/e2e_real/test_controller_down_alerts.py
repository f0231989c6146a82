"""With the controller stopped, the chart's alerts fire on a real Prometheus: it scrapes the
webhook and the controller of the real control plane (as the chart's ServiceMonitor would, under
the same job names) and evaluates the chart's PrometheusRule (its `for` shortened to seconds).
The controller leads, nothing fires; the controller stops, a Job is held by the webhook, and
XmemControllerDown and XmemWorkloadsHeldWithoutController fire, the latter read from the
webhook's own counter."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Any, Dict, List

import yaml

from localkube.cluster import render_chart
from localkube.controlplane import free_port, wait_for
from tests.e2e_real.support import held, job
from tests.helm.chart import tool
from tests.rightsizing.prometheus import stop

RULES = {"metrics": {"prometheusRule": {"enabled": True, "controllerDownFor": "3s",
                                        "heldWithoutControllerWindow": "10m"}}}


def _port(log: str, pattern: str) -> int:
    found = re.search(pattern, log)
    return int(found.group(1)) if found else 0


def _prometheus(work: Path, targets: Dict[str, int]) -> Any:
    [rule] = [d for d in render_chart(RULES) if d["kind"] == "PrometheusRule"]
    (work / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(work / "rules.yaml")],
              "scrape_configs": [{"job_name": name, "static_configs": [
                  {"targets": [f"127.0.0.1:{port}"]}]} for name, port in targets.items()]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [tool("prometheus"), f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.loads(answer.read())["data"]


def _firing(url: str) -> List[Dict[str, Any]]:
    return [a for a in _get(f"{url}/api/v1/alerts")["alerts"] if a["state"] == "firing"]


def test_stopping_the_controller_fires_its_alerts_on_a_real_prometheus(xmem, tmp_path):
    cluster, ns = xmem.cluster, xmem.namespace
    webhook = xmem.serve()
    controller = xmem.controller()
    health = wait_for(lambda: _port(cluster.log(webhook.name),
                                    r"health on http://127\.0\.0\.1:(\d+)"), 30, "webhook port")
    name = f"controller-{ns}-0"
    metrics = wait_for(lambda: _port(cluster.log(name), r"metrics on http://127\.0\.0\.1:(\d+)"),
                       60, "the controller's metrics port")
    process, url = _prometheus(tmp_path, {"xmem-xmem-admission-controller-metrics": metrics,
                                          "xmem-xmem-admission-webhook": health})
    try:
        # Leading (the session's Lease may first have to expire) and scraped: nothing fires
        # (XmemControllerDown fired before the first scrape, and resolves).
        wait_for(lambda: any(r["value"][1] == "1" for r in _get(
            f"{url}/api/v1/query?query=max(xmem_controller_leader)")["result"])
            and _firing(url) == [], 90, "Prometheus to see the controller lead, no alert firing")

        cluster.stop_process(controller)
        created = cluster.apply(job("waiting", ns))
        assert held(created)
        alerts = wait_for(lambda: (lambda f: f if {a["labels"]["alertname"] for a in f} >= {
            "XmemControllerDown", "XmemWorkloadsHeldWithoutController"} else None)(
            _firing(url)), 60, "the controller alerts to fire")
        [waiting] = [a for a in alerts
                     if a["labels"]["alertname"] == "XmemWorkloadsHeldWithoutController"]
        assert waiting["labels"]["kind"] == "Job"
        assert "while no xmem controller leads" in waiting["annotations"]["description"]
        # Stopped, not standing by: the not-leading alert is for replicas that run.
        assert "XmemControllerNotLeading" not in {a["labels"]["alertname"] for a in alerts}
    finally:
        stop(process)
