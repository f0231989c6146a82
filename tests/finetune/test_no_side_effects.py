"""An estimate does nothing outside itself: no MLflow or W&B run, no Hugging Face Hub push.

Each script (``scripts/tracker_*.py``) fine-tunes a tiny Llama with transformers' ``Trainer``
and reports to a real tracker, or pushes to the Hub, at a server the test runs: a real MLflow
tracking server, a socket where W&B's client would connect, an HTTP server standing for the
Hub. Estimated with ``xmem estimate`` (the torch environment with the fine-tuning stack,
``NEWEST``: wandb, mlflow and transformers installed), the servers see nothing; run as plain
Python on the CPU, the same script reaches them, so each check can fail. The estimation pod's
spec carries the same switches (``contract.side_effects``).
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from localkube.controlplane import wait_while_running
from tests.controller.support import make_policy, training_job
from tests.support.torch_envs import NEWEST
from xmem_admission import bundle
from xmem_admission.cluster.controller import podspec, records
from xmem_admission.contract import probe_env, side_effects, termination
from xmem_admission.estimator.probe.side_effects import (
    CHECKPOINT_NOTE,
    MLFLOW_NOTE,
    PUSH_NOTE,
    WANDB_NOTE,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 characters, as W&B's keys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    for name in side_effects.VARIABLES:  # what the test's own environment may hold
        env.pop(name, None)
    env.update(extra)
    return env


def estimate(script: str, args: List[str], cwd: Path, env: Dict[str, str], mode: str = "auto",
             python: Optional[str] = None
             ) -> Tuple[subprocess.CompletedProcess, Optional[Dict[str, Any]]]:
    """``xmem estimate --json`` of ``script`` with the fine-tuning environment (or ``python``);
    the process and the trace it wrote (None when the estimate failed)."""
    trace = cwd / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "xmem_admission.cli", "estimate", "--python",
         python or NEWEST.interpreter,
         "--json", "--gpu", "H100-80GB", "--mode", mode, "--trace", str(trace), "--",
         "python", str(SCRIPTS / script), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return proc, (json.loads(trace.read_text()) if trace.is_file() else None)


def plain(script: str, args: List[str], cwd: Path, env: Dict[str, str]) -> subprocess.Popen:
    """The same script as plain Python, no probe, on the CPU, in a session of its own."""
    return subprocess.Popen([NEWEST.interpreter, str(SCRIPTS / script), *args, "--cpu",
                             "--steps", "1"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def turned_off(trace: Dict[str, Any]) -> List[str]:
    return [n["message"] for n in trace["meta"].get("notes", []) if n["kind"] == "turned_off"]


def script_args(checkpoint: Path, cwd: Path) -> List[str]:
    return ["--model", str(checkpoint), "--output", str(cwd / "out")]


# -- MLflow -------------------------------------------------------------------------------------

class MLflowServer:
    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        mlflow = str(Path(NEWEST.interpreter).parent / "mlflow")
        self.log = (folder / "server.log").open("w")
        self.proc = subprocess.Popen(
            [mlflow, "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
             "--default-artifact-root", str(folder / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            cwd=folder, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> None:
        def answers() -> bool:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as reply:
                return bool(reply.status == 200)

        # a refused connection or a server too busy to answer within the 10 s is tried again
        wait_while_running(answers, f"the mlflow server to answer (its log: {self.log.name})",
                           self.proc, timeout=timeout, interval=0.5)

    def post(self, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            answer: Dict[str, Any] = json.loads(reply.read() or b"{}")
            return answer

    def experiments(self) -> List[str]:
        found = self.post("/api/2.0/mlflow/experiments/search", {"max_results": 1000})
        return [e["name"] for e in found.get("experiments", [])]

    def runs(self) -> List[str]:
        ids = [e["experiment_id"] for e in self.post(
            "/api/2.0/mlflow/experiments/search", {"max_results": 1000})["experiments"]]
        found = self.post("/api/2.0/mlflow/runs/search", {"experiment_ids": ids})
        return sorted(r["info"]["run_name"] for r in found.get("runs", []))

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # a throw-away server: its gunicorn/huey too
        self.proc.wait(timeout=60)
        self.log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MLflowServer]:
    folder = tmp_path_factory.mktemp("mlflow-server")
    server = MLflowServer(folder)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_an_estimate_records_no_mlflow_run_where_the_script_itself_records_two(
        mlflow_server, llama_checkpoint, tmp_path):
    work = tmp_path / "estimated"
    work.mkdir()
    args = script_args(llama_checkpoint, work) + ["--tracking-uri", mlflow_server.url]
    proc, trace = estimate("tracker_mlflow.py", args, work, environment())
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == 3
    assert trace is not None and MLFLOW_NOTE in turned_off(trace)
    assert mlflow_server.runs() == [] and mlflow_server.experiments() == ["Default"]
    # nor MLflow 3's default store in the working directory
    assert sorted(p.name for p in work.iterdir()) == ["out", "trace.json"]

    control = tmp_path / "plain"
    control.mkdir()
    args = script_args(llama_checkpoint, control) + ["--tracking-uri", mlflow_server.url]
    run = plain("tracker_mlflow.py", args, control, environment())
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output
    runs = mlflow_server.runs()
    assert len(runs) == 2 and "prepare" in runs, runs  # its own and the Trainer's


def test_an_estimation_pods_probe_keeps_the_mlflow_runs_in_its_scratch_folder(
        mlflow_server, llama_checkpoint, tmp_path):
    """As the estimation pod runs it: the bundle's sitecustomize starts the probe in the
    script's own interpreter (``sitehook``), with the pod's scratch folder."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = tmp_path / "termination-log"
    env = environment(PYTHONPATH=bundle.cached(), **{
        probe_env.ON: probe_env.ON_VALUE, probe_env.GPUS: "H100-80GB", probe_env.STEPS: "2",
        probe_env.MODE: "auto", probe_env.RESULT_PATH: str(result),
        probe_env.SCRATCH: str(scratch)})
    before = mlflow_server.runs()
    args = script_args(llama_checkpoint, tmp_path) + ["--tracking-uri", mlflow_server.url]
    done = subprocess.run([NEWEST.interpreter, str(SCRIPTS / "tracker_mlflow.py"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert termination.decode(result.read_text()).status == "ok"
    assert mlflow_server.runs() == before
    stored = list((scratch / side_effects.MLFLOW_STORE).glob("*/*/meta.yaml"))  # experiment/run
    assert len(stored) == 2, stored  # its own run and the Trainer's, thrown away with the pod


# -- Weights & Biases ---------------------------------------------------------------------------

class Listener:
    """A TCP port where W&B's client would connect (``WANDB_BASE_URL``): says when one does."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connected = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connected.set()
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_an_estimate_starts_no_wandb_run_where_the_script_itself_connects(
        llama_checkpoint, tmp_path):
    listener = Listener()
    env = environment(WANDB_MODE="online", WANDB_BASE_URL=listener.url, WANDB_API_KEY=WANDB_KEY)
    try:
        work = tmp_path / "estimated"
        work.mkdir()
        proc, trace = estimate("tracker_wandb.py", script_args(llama_checkpoint, work), work, env)
        assert proc.returncode == 0, proc.stderr
        assert trace is not None and WANDB_NOTE in turned_off(trace)
        assert not listener.connected.is_set()
        assert not (work / "wandb").exists()  # an offline run would write wandb/offline-run-*

        control = tmp_path / "plain"
        control.mkdir()
        run = plain("tracker_wandb.py", script_args(llama_checkpoint, control), control, env)
        try:
            arrived = listener.connected.wait(timeout=300)
        finally:
            os.killpg(run.pid, signal.SIGKILL)  # with wandb-core, its service process
            output, _ = run.communicate(timeout=60)
        assert arrived, output  # W&B's login query (POST /graphql), before any run folder
    finally:
        listener.close()


# -- the Hugging Face Hub -----------------------------------------------------------------------

class HubStandIn:
    """An HTTP server at ``HF_ENDPOINT`` that records each request and answers 404 to reads and
    500 to writes (no repository exists; none can be made)."""

    def __init__(self) -> None:
        seen: List[Tuple[str, str]] = []
        self.seen = seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                seen.append((self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                self.send_response(404 if self.command in ("GET", "HEAD") else 500)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def writes(self) -> List[Tuple[str, str]]:
        return [(m, p) for m, p in self.seen if m not in ("GET", "HEAD")]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub() -> Iterator[HubStandIn]:
    server = HubStandIn()
    yield server
    server.close()


def test_a_trainer_that_pushes_to_the_hub_at_every_save_is_estimated_without_a_write(
        hub, llama_checkpoint, tmp_path):
    work = tmp_path / "estimated"
    work.mkdir()
    env = environment(HF_ENDPOINT=hub.url)
    # the Trainer would save a checkpoint at each step (save_steps=1), where
    # hub_strategy="every_save" would push it: in either mode, it saves none
    for mode in ("fake", "profile"):
        proc, trace = estimate("tracker_hub.py", script_args(llama_checkpoint, work), work, env,
                               mode=mode)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["mode"] == mode
        assert trace is not None and PUSH_NOTE in turned_off(trace)
        assert CHECKPOINT_NOTE in turned_off(trace)
        assert not list((work / "out").glob("checkpoint-*"))  # nothing on the job's volume
        assert hub.seen == []

    control = tmp_path / "plain"
    control.mkdir()
    run = plain("tracker_hub.py", script_args(llama_checkpoint, control), control, env)
    output, _ = run.communicate(timeout=600)
    assert ("POST", "/api/repos/create") in hub.writes(), output


def test_a_script_that_creates_a_hub_repository_itself_is_refused_before_the_write(
        hub, llama_checkpoint, tmp_path):
    proc, _ = estimate("tracker_hub.py", script_args(llama_checkpoint, tmp_path) + ["--direct"],
                       tmp_path, environment(HF_ENDPOINT=hub.url))
    assert proc.returncode == 2, proc.stderr
    assert (f"not estimated: the script writes to the Hugging Face Hub (POST {hub.url}"
            f"/api/repos/create)") in proc.stderr
    assert hub.seen == [("GET", "/api/models/xmem-tests/tiny-llama")]  # reads still go out


def test_with_huggingface_hub_before_1_0_a_write_is_refused_as_well(hub, tmp_path):
    """The project's own environment: transformers 4.51 on huggingface_hub 0.x, whose HTTP
    client is a requests session (its adapter's ``send`` refuses the write)."""
    import huggingface_hub

    assert huggingface_hub.__version__.startswith("0."), huggingface_hub.__version__
    args = ["--model", str(tmp_path / "unused"), "--output", str(tmp_path / "out"), "--direct"]
    proc, _ = estimate("tracker_hub.py", args, tmp_path, environment(HF_ENDPOINT=hub.url),
                       python=sys.executable)
    assert proc.returncode == 2, proc.stderr
    assert (f"not estimated: the script writes to the Hugging Face Hub (POST {hub.url}"
            f"/api/repos/create)") in proc.stderr
    assert hub.seen == [("GET", "/api/models/xmem-tests/tiny-llama")]


# -- the estimation pod -------------------------------------------------------------------------

def test_the_estimation_pod_turns_the_trackers_off_in_place_of_the_jobs_own_settings():
    job = training_job("train")
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "WANDB_MODE", "value": "online"},
                        {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.team:5000"},
                        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {
                            "name": "wandb", "key": "key"}}}]
    job["metadata"]["uid"] = "u-1"
    gme = records.new(job, "a" * 32, ["H100-80GB"], "img")
    gme["metadata"]["uid"] = "gme-uid"
    template = job["spec"]["template"]
    pod = podspec.build(gme, job, template, template["spec"]["containers"][0],
                        make_policy().defaults, "registry.example/xmem-admission:1.0")
    main = pod["spec"]["containers"][0]
    names = [e["name"] for e in main["env"]]
    values = {e["name"]: e.get("value", e.get("valueFrom")) for e in main["env"]}
    wanted = side_effects.environment(podspec.SCRATCH_DIR)
    assert {name: values[name] for name in wanted} == wanted
    assert all(names.count(name) == 1 for name in wanted)
    assert values["WANDB_MODE"] == "disabled"
    assert values["MLFLOW_TRACKING_URI"] == f"file://{podspec.SCRATCH_DIR}/mlruns"
    assert values["WANDB_API_KEY"] == {"secretKeyRef": {"name": "wandb", "key": "key"}}
    # the throw-away MLflow store is in the pod's own scratch volume, writable for its user
    assert any(m["mountPath"] == podspec.SCRATCH_DIR for m in main["volumeMounts"])
