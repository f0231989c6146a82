"""Where the policy comes from: a file reloaded on change, or the cluster's GPUAdmissionPolicy
read with the official Kubernetes client from a stand-in API server on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
import yaml

from tests.support.schemas import ROOT
from xmem_admission.cluster.policy.sources import ClusterPolicySource, FilePolicySource
from xmem_admission.contract.errors import PolicyError

EXAMPLE = ROOT / "examples" / "policy.yaml"
PATH = "/apis/xmem.io/v1alpha1/gpuadmissionpolicies/default"


def test_a_policy_file_is_reloaded_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(EXAMPLE.read_text())
    source = FilePolicySource(str(path))
    assert not source.current().for_namespace("dev").enforcing
    path.write_text(EXAMPLE.read_text().replace("enforcement: Warn", "enforcement: Enforce  # now"))
    source.refresh()
    assert source.current().for_namespace("dev").enforcing and source.error is None


def test_a_broken_reload_keeps_the_last_good_policy_and_reports_it(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(EXAMPLE.read_text())
    errors: List[str] = []
    source = FilePolicySource(str(path), on_error=errors.append)
    good = source.current()
    path.write_text(EXAMPLE.read_text().replace("backend: hami", "backend: nope"))
    source.refresh()
    assert source.current() is good
    assert "spec.targets[0].backend" in (source.error or "") and errors == ["reload"]


def test_a_broken_file_at_startup_is_an_error() -> None:
    with pytest.raises(PolicyError):
        FilePolicySource(str(ROOT / "pyproject.toml"))


class StandInApiServer:
    """Serves one cluster-scoped custom object at its real REST path, or 404 (a Status)."""

    def __init__(self) -> None:
        self.obj: Optional[Dict[str, Any]] = None
        self.requests: List[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.requests.append(self.path)
                if self.path == PATH and outer.obj is not None:
                    body, code = json.dumps(outer.obj).encode(), 200
                else:
                    body, code = json.dumps({
                        "kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "message": 'gpuadmissionpolicies.xmem.io "default" not found',
                        "reason": "NotFound", "code": 404,
                    }).encode(), 404
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "t0ken"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        }))
        return path

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def apiserver() -> Iterator[StandInApiServer]:
    server = StandInApiServer()
    yield server
    server.close()


def _policy_object(version: str, enforcement: str) -> Dict[str, Any]:
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"].update({"resourceVersion": version, "generation": int(version)})
    obj["spec"]["enforcement"] = enforcement
    return obj


def test_the_cluster_policy_is_read_with_the_official_client(apiserver: StandInApiServer, tmp_path: Path) -> None:
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(apiserver.kubeconfig(tmp_path)))
    errors: List[str] = []
    source = ClusterPolicySource(client, "default", on_error=errors.append)
    source.refresh()
    assert source.current() is None and "not found" in (source.error or "")
    assert errors == ["fetch"]

    apiserver.obj = _policy_object("7", "Warn")
    source.refresh()
    first = source.current()
    assert first is not None and first.generation == 7 and source.error is None
    source.refresh()
    assert source.current() is first  # same resourceVersion: not parsed again

    apiserver.obj = _policy_object("8", "Enforce")
    source.refresh()
    assert source.current().for_namespace("dev").enforcing

    apiserver.obj = None
    source.refresh()
    assert source.current().for_namespace("dev").enforcing  # the last good policy stays
    assert apiserver.requests and all(r == PATH for r in apiserver.requests)
