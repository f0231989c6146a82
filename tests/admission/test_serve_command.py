"""``xmem serve`` as a user runs it: a real process, flags or environment, clean errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import orjson
import pytest

from localkube.controlplane import free_port
from tests.support.builders import make_job, make_pod, review
from tests.support.harness import Answer, Certificates
from tests.support.schemas import ROOT

EXAMPLE = ROOT / "examples" / "policy.yaml"


def xmem(*args: str, env: Dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xmem_admission.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture()
def env(certs: Certificates) -> Dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("XMEM_", "KUBERNETES_"))}
    out.update(PYTHONPATH=str(ROOT / "src"), KUBECONFIG=str(ROOT / "no-such-kubeconfig"),
               XMEM_CERT_FILE=str(certs.cert_file), XMEM_KEY_FILE=str(certs.key_file),
               XMEM_HOST="127.0.0.1")
    return out


class Running:
    def __init__(self, env: Dict[str, str], *args: str):
        self.port, self.health = free_port(), free_port()
        env = dict(env, XMEM_PORT=str(self.port), XMEM_METRICS_PORT=str(self.health))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xmem_admission.cli", "serve", "--reload-seconds", "0.2", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{self.health}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("xmem serve did not become ready")

    def send(self, certs: Certificates, request: dict, path: str = "/mutate") -> Answer:
        with httpx.Client(verify=certs.client_context(), timeout=10) as client:
            reply = client.post(f"https://localhost:{self.port}{path}", content=orjson.dumps(request))
        assert reply.status_code == 200
        return Answer(reply.json(), request)

    def stop(self) -> subprocess.CompletedProcess:
        self.process.send_signal(signal.SIGTERM)
        out, err = self.process.communicate(timeout=15)
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, out, err)


@pytest.fixture()
def running(env: Dict[str, str]) -> Iterator[List[Running]]:
    started: List[Running] = []
    yield started
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.communicate()


def test_serve_from_environment_variables_answers_and_stops_cleanly_on_sigterm(
    env: Dict[str, str], certs: Certificates, running: List[Running]
) -> None:
    server = Running(dict(env, XMEM_POLICY=str(EXAMPLE)))
    running.append(server)
    answer = server.send(certs, review(make_job("j").opt_in().gpus(1).obj()))
    assert answer.patched()["spec"]["suspend"] is True
    metrics = httpx.get(f"http://127.0.0.1:{server.health}/metrics").text
    assert "xmem_admission_requests_total" in metrics
    done = server.stop()
    assert done.returncode == 0
    assert "admission on https://127.0.0.1" in done.stderr and "policy " in done.stderr


def test_an_edited_policy_file_takes_effect_without_a_restart(
    env: Dict[str, str], certs: Certificates, running: List[Running], tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(EXAMPLE.read_text())
    server = Running(env, "--policy", str(policy))
    running.append(server)
    bare_pod = make_pod("p").opt_in().gpus(1).obj()  # admitted while warning, denied when enforcing
    assert server.send(certs, review(bare_pod), "/validate").allowed
    policy.write_text(EXAMPLE.read_text().replace("enforcement: Warn", "enforcement: Enforce"))
    deadline = time.monotonic() + 10
    answer = server.send(certs, review(bare_pod), "/validate")
    while answer.allowed and time.monotonic() < deadline:
        time.sleep(0.1)
        answer = server.send(certs, review(bare_pod), "/validate")
    assert not answer.allowed and "bare Pod" in answer.status["message"]


def test_serve_reads_the_cluster_policy_when_no_file_is_given(
    env: Dict[str, str], certs: Certificates, running: List[Running], cluster: Any
) -> None:
    """The real API server (the session's control plane) holds the GPUAdmissionPolicy."""
    import yaml

    name = "serve-command-test"
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"] = {"name": name}
    cluster.apply(obj)
    try:
        server = Running(dict(env, KUBECONFIG=str(cluster.plane.admin_kubeconfig),
                              XMEM_POLICY_NAME=name))
        running.append(server)
        answer = server.send(certs, review(make_job("j").opt_in().gpus(1).obj()))
        assert answer.patched()["spec"]["suspend"] is True
        assert f"policy GPUAdmissionPolicy/{name}" in server.stop().stderr
    finally:
        cluster.delete("xmem.io/v1alpha1", "GPUAdmissionPolicy", name)


@pytest.mark.parametrize(
    "args, extra_env, message",
    [
        (["--policy", str(EXAMPLE), "--cert-file", "/nonexistent.crt"], {},
         "/nonexistent.crt: no such file"),
        (["--policy", str(ROOT / "pyproject.toml")], {}, "not valid YAML"),
        ([], {}, "no policy: pass --policy FILE.yaml"),
        (["--policy", str(EXAMPLE), "--estimates", str(ROOT / "README.md")], {}, "not a directory"),
        (["--policy", str(EXAMPLE), "--controller-user", ""], {},
         "--controller-user is empty: nothing could release a held workload"),
    ],
)
def test_bad_input_is_one_error_line_and_a_non_zero_exit(
    env: Dict[str, str], args: List[str], extra_env: Dict[str, str], message: str
) -> None:
    done = xmem("serve", *args, env=dict(env, **extra_env))
    assert done.returncode == 2
    assert done.stderr.startswith("xmem serve: error: ") and message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_port_in_use_is_reported(env: Dict[str, str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = xmem("serve", "--policy", str(EXAMPLE), "--port", str(port), env=env)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr
