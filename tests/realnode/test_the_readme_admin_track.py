"""The README's admin track, followed as written on a real node.

The commands are read from README.md itself (the first ``sh`` block under "Install on a cluster
(admin)"), so editing the README changes what runs here. Each logical line runs in ``bash`` from
the repository's root, in order, with only what the README tells an admin to substitute:

- ``registry.example.com`` is the real node's own registry (``localkube/kubelet.py``: plain http
  on ``127.0.0.1:PORT``, which the node's containerd pulls from; podman is told it is plain http
  through ``CONTAINERS_REGISTRIES_CONF``, as an admin's ``registries.conf`` would);
- ``examples/sample-job.yaml``'s public PyTorch image (no public registry is reachable here) is a
  training image with torch 2.15 pushed into that registry, which the README allows ("any image
  with torch 2.2-2.15 will do"); nothing else of the file changes;
- on a node with fewer CPUs free than an estimation pod asks for (2), the ``helm install`` line
  gets the README's own ``--set`` for small nodes;
- ``sudo`` is dropped where the tests already run as root and no sudo is installed.

``PATH`` starts with the project's ``.tools/bin`` (helm, kubectl 1.35) and ``KUBECONFIG`` names
the control plane's admin. The watch (the line with ``-w``) runs until what it prints shows the
Job no longer Suspended, then is stopped, as a user stops it with Ctrl-C. What a user sees is
asserted: the Job suspended at CREATE, the watch's Suspended then Running, ``kubectl get gme``'s
row for the Job with a GPU model and a request, the Job's template carrying
``xmem.io/request-bytes`` and its pod sized; after ``helm uninstall``, every object of the
release, the two namespaces and the cluster is listed (before and after) and what is left is
exactly what docs/operations.md ("Upgrade and uninstall") says is left. Each command's time is
printed (``-s``: ``make node-test``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from tests.realnode.conftest import ENABLED, SKIP_REASON

if not ENABLED:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import yaml  # noqa: E402

from localkube.cluster import helm  # noqa: E402
from localkube.controlplane import ControlPlane, wait_for, wait_while_running  # noqa: E402
from localkube.kubelet import RealNode, _host_address  # noqa: E402
from xmem_admission.cluster import labels  # noqa: E402

pytestmark = pytest.mark.timeout(3600)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = "## Install on a cluster (admin)"
OPERATIONS = ROOT / "docs" / "operations.md"
UNINSTALL = "## Upgrade and uninstall with jobs held"
REGISTRY = "registry.example.com"
SAMPLE = "examples/sample-job.yaml"
SMALL_NODE = "--set policy.spec.estimation.resources.cpu=1"
RELEASE, RELEASE_NAMESPACE, TENANT, JOB = "xmem", "xmem-system", "ml-team", "gpt-sample"
FULLNAME = f"{RELEASE}-xmem-admission"
# What docs/operations.md ("Upgrade and uninstall with jobs held") says `helm uninstall` leaves,
# each by its name there: the two CRDs (with the APIService the API server keeps for their
# group), in selfSigned mode the two certificate Secrets, the controller's leader-election Lease,
# and the namespace `--create-namespace` made.
LEFT_BY_DESIGN = {
    ("CustomResourceDefinition", "", "gpuadmissionpolicies.xmem.io"),
    ("CustomResourceDefinition", "", "gpumemoryestimates.xmem.io"),
    ("APIService", "", "v1alpha1.xmem.io"),
    ("Secret", RELEASE_NAMESPACE, f"{FULLNAME}-webhook-tls"),
    ("Secret", RELEASE_NAMESPACE, f"{FULLNAME}-webhook-tls-ca"),
    ("Lease", RELEASE_NAMESPACE, f"{FULLNAME}-controller"),
    ("Namespace", "", RELEASE_NAMESPACE),
}
# What Kubernetes puts in every namespace, and what the admin made in the tenant's.
EVERY_NAMESPACE = {("ServiceAccount", "default"), ("ConfigMap", "kube-root-ca.crt")}
THE_ADMINS = {("Namespace", "", TENANT), ("ConfigMap", TENANT, "train-gpt")}
NOT_OBJECTS = {"events", "events.events.k8s.io", "componentstatuses"}

Key = Tuple[str, str, str]  # kind, namespace, name


def section(text: str, heading: str) -> str:
    """From ``heading`` to the next heading of its level."""
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def admin_commands(text: str) -> List[str]:
    """The admin section's first ``sh`` block, one entry per logical line (``\\`` joined)."""
    block = re.search(r"```sh\n(.*?)```", section(text, SECTION), re.S)
    assert block, f"README.md: no ```sh block under {SECTION!r}"
    joined = re.sub(r"\s*\\\n\s*", " ", block.group(1))
    return [line.strip() for line in joined.splitlines() if line.strip()]


@dataclass
class Ran:
    command: str
    seconds: float
    output: str


class Track:
    """The cluster the admin is given (a control plane, one real node with its registry) and
    the README's commands run against it."""

    def __init__(self, plane: ControlPlane, node: RealNode, work: Path, train: str) -> None:
        self.plane, self.node, self.work, self.train = plane, node, work, train
        self.ran: List[Ran] = []
        registries = work / "registries.conf"
        registries.write_text(f'[[registry]]\nlocation = "{node.registry.address}"\n'
                              f"insecure = true\n")
        tools = Path(helm()).parent
        self.env = dict(os.environ, KUBECONFIG=str(plane.admin_kubeconfig),
                        CONTAINERS_REGISTRIES_CONF=str(registries),
                        PATH=f"{tools}:{os.environ.get('PATH', '')}")
        sample = yaml.safe_load((ROOT / SAMPLE).read_text())
        [container] = sample["spec"]["template"]["spec"]["containers"]
        container["image"] = train
        self.sample = work / "sample-job.yaml"
        self.sample.write_text(yaml.safe_dump(sample))

    def as_run(self, command: str) -> str:
        """``command`` with the substitutions the README allows (module docstring)."""
        command = command.replace(REGISTRY, self.node.registry.address)
        command = command.replace(SAMPLE, str(self.sample))
        if command.startswith("sudo ") and os.geteuid() == 0 and not shutil.which("sudo"):
            command = command[len("sudo "):]
        if command.startswith("helm install") and self.cpus_free() < 2:
            command += " " + SMALL_NODE
        return command

    def cpus_free(self) -> float:
        """The node's allocatable CPUs less what the chart's four pods request (100m each)."""
        node = self.kubectl_json("get", "node", self.node.name)
        cpu = node["status"]["allocatable"]["cpu"]
        return (int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)) - 0.4

    def run(self, command: str, timeout: float = 1800) -> Ran:
        began = time.monotonic()
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=self.env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
        ran = Ran(command, time.monotonic() - began, done.stdout)
        self.ran.append(ran)
        print(f"\n$ {command}   # {ran.seconds:.1f} s, exit {done.returncode}\n"
              f"{_tail(done.stdout)}", flush=True)
        assert done.returncode == 0, f"{command} failed:\n{done.stdout[-6000:]}\n{self.story()}"
        return ran

    def watch(self, command: str, timeout: float = 1500) -> Ran:
        """Run a ``kubectl get job ... -w`` until a row it prints shows the Job no longer
        Suspended, then stop it (the user's Ctrl-C). Its exit before then fails at once."""
        log = self.work / "watch.log"
        began = time.monotonic()

        def shown_released() -> bool:
            rows = [r for r in table(log.read_text()) if r.get("NAME") == JOB]
            return bool(rows) and rows[-1].get("STATUS") not in ("Suspended", "")

        with log.open("w") as out:
            process = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=self.env,
                                       stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                wait_while_running(shown_released, f"the watch to show {JOB} released",
                                   process, timeout, interval=1)
            except Exception as err:  # noqa: BLE001 - the watch's output and the story
                raise AssertionError(f"{err}\n{log.read_text()}\n{self.story()}") from err
            finally:
                if process.poll() is None:
                    os.killpg(process.pid, 15)
                process.wait(30)
        ran = Ran(command, time.monotonic() - began, log.read_text())
        self.ran.append(ran)
        print(f"\n$ {command}   # stopped once released: {ran.seconds:.1f} s\n{ran.output}",
              flush=True)
        return ran

    def released(self) -> Optional[Dict[str, Any]]:
        job = self.kubectl_json("get", "job", JOB, "-n", TENANT, check=False)
        return job if job and not job["spec"].get("suspend") else None

    def kubectl_json(self, *args: str, check: bool = True) -> Dict[str, Any]:
        done = subprocess.run(["kubectl", *args, "-o", "json"], env=self.env, text=True,
                              capture_output=True, timeout=120)
        if done.returncode != 0:
            assert not check, f"kubectl {' '.join(args)}: {done.stderr}"
            return {}
        return dict(json.loads(done.stdout))

    def objects(self) -> Dict[Key, Dict[str, Any]]:
        """Every object of the release, of the two namespaces, and every cluster object that
        names xmem or carries the release's labels or Helm's annotations (events aside)."""
        kinds = subprocess.run(["kubectl", "api-resources", "--verbs=list", "-o", "name"],
                               env=self.env, text=True, capture_output=True, timeout=120)
        names = [n for n in kinds.stdout.split() if n not in NOT_OBJECTS]
        listed = subprocess.run(["kubectl", "get", ",".join(names), "-A", "-o", "json"],
                                env=self.env, text=True, capture_output=True, timeout=300)
        found: Dict[Key, Dict[str, Any]] = {}
        for obj in json.loads(listed.stdout)["items"]:
            meta = obj["metadata"]
            namespace = meta.get("namespace", "")
            ours = (namespace in (RELEASE_NAMESPACE, TENANT)
                    or (meta.get("labels") or {}).get("app.kubernetes.io/instance") == RELEASE
                    or (meta.get("annotations") or {}).get("meta.helm.sh/release-name") == RELEASE
                    or "xmem" in meta["name"] or meta["name"] in (TENANT, RELEASE_NAMESPACE))
            if ours:
                found[(obj["kind"], namespace, meta["name"])] = obj
        return found

    def story(self) -> str:
        lines = []
        for namespace in (RELEASE_NAMESPACE, TENANT):
            pods = self.kubectl_json("get", "pods", "-n", namespace, check=False)
            for pod in pods.get("items", []):
                lines.append(f"pod {namespace}/{pod['metadata']['name']}: "
                             f"{json.dumps(pod.get('status'))[:700]}")
            events = self.kubectl_json("get", "events", "-n", namespace, check=False)
            lines += [f"event {namespace}/{e['involvedObject']['name']}: {e['reason']}: "
                      f"{e['message']}" for e in events.get("items", [])]
        return "\n".join(lines)[-12000:]


def table(output: str) -> List[Dict[str, str]]:
    """The rows of ``kubectl get``'s table (every header line starts one), cut at the header's
    column starts, so an empty cell stays empty."""
    rows: List[Dict[str, str]] = []
    columns: List[Tuple[str, int]] = []
    for line in output.splitlines():
        if line.startswith("NAME "):
            columns = [(m.group(), m.start()) for m in re.finditer(r"\S+", line)]
            continue
        if not columns or not line.strip():
            continue
        ends = [start for _, start in columns[1:]] + [len(line)]
        rows.append({name: line[start:end].strip()
                     for (name, start), end in zip(columns, ends)})
    return rows


def _tail(text: str, lines: int = 15) -> str:
    kept = text.rstrip().splitlines()
    return "\n".join((["..."] if len(kept) > lines else []) + kept[-lines:])


@pytest.fixture(scope="module")
def track(tmp_path_factory: pytest.TempPathFactory, sandbox_image: str,
          training_image: Any) -> Iterator[Track]:
    root = tmp_path_factory.mktemp("admin")
    plane = ControlPlane(root / "plane", address=_host_address())
    node = RealNode(plane, root / "node", name="admin-track-node", services=True)
    try:
        plane.start()
        node.start(sandbox_image)
        began = time.monotonic()
        train = node.registry.push(training_image("2.15.0", "3.13"), "team/train:2.15")
        print(f"\nthe team's training image pushed into the node's registry "
              f"(not a README step): {time.monotonic() - began:.0f} s", flush=True)
        yield Track(plane, node, root, train)
    finally:
        node.stop()
        plane.stop()


def test_the_readme_admin_track_ends_with_a_released_job_and_uninstall_leaves_what_the_docs_say(
        track: Track) -> None:
    commands = admin_commands(README.read_text())
    assert SMALL_NODE in README.read_text(), "the README no longer says how to size small nodes"
    assert commands[-1].startswith(f"kubectl delete -f {SAMPLE} && helm uninstall"), commands
    [at] = [i for i, c in enumerate(commands) if re.search(r" -w\b", c)]
    until_watch, watch, after_watch = commands[:at], commands[at], commands[at + 1:-1]
    began = time.monotonic()
    for command in until_watch:
        track.run(track.as_run(command))
        if "kubectl apply" in command:
            created = track.kubectl_json("get", "job", JOB, "-n", TENANT)
            # held at CREATE by the chart's webhook pod
            assert created["spec"].get("suspend") is True, (created, track.story())
            assert labels.HELD_REASON in created["metadata"].get("annotations", {}), created
    seen = track.watch(track.as_run(watch))
    print(f"\nfrom the first command to the Job released: {time.monotonic() - began:.0f} s")
    # what the watch showed: the Job Suspended while it was estimated, then released
    statuses = [r["STATUS"] for r in table(seen.output) if r.get("NAME") == JOB]
    assert statuses and statuses[0] == "Suspended" and statuses[-1] == "Running", seen.output

    job = track.released()
    assert job is not None, track.story()
    request = int(job["spec"]["template"]["metadata"]["annotations"][labels.REQUEST_BYTES])
    assert request >= 1 << 30, job["spec"]["template"]["metadata"]
    estimates = track.kubectl_json("get", "gme", "-n", TENANT)["items"]
    assert [g["spec"]["workload"]["name"] for g in estimates] == [JOB], estimates
    assert not any(g["metadata"].get("ownerReferences") for g in estimates), estimates
    shown = [track.run(track.as_run(command)) for command in after_watch]
    # `kubectl get gme`: the Job's estimate, with the GPU model it was sized for, recorded
    [gme] = [r for ran in shown if ran.command.startswith("kubectl get gme")
             for r in table(ran.output)]
    assert gme["WORKLOAD"].endswith(JOB) and gme["GPU"] and gme["ESTIMATE"], shown[-1].output
    assert (gme["PHASE"], gme["REASON"]) == ("Succeeded", "Traced"), shown[-1].output

    def sized_pod() -> Optional[Dict[str, Any]]:
        pods = track.kubectl_json("get", "pods", "-n", TENANT, "-l", f"job-name={JOB}")
        return pods["items"][0] if pods.get("items") else None

    pod = wait_for(sized_pod, 120, f"the pod of {JOB}")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpumem"]) * (1 << 20) >= request, limits  # MiB (HAMi)
    print(f"released with {labels.REQUEST_BYTES}={request} ({request / (1 << 30):.2f} GiB); "
          f"its pod asks for nvidia.com/gpumem={limits['nvidia.com/gpumem']}")

    before = track.objects()
    track.run(track.as_run(commands[-1]), timeout=600)

    # The garbage collector removes the Job's pods, and the chart's pods stop; the estimate,
    # owned by no workload, stays (docs/admission.md, "Estimates outlive their jobs").
    def settled() -> Optional[Dict[Key, Dict[str, Any]]]:
        now = track.objects()
        going = [k for k, o in now.items() if k[0] in ("Pod", "Job")
                 or o["metadata"].get("deletionTimestamp")]
        return None if going else now

    after = wait_for(settled, 300, "the Job's and the chart's objects gone", interval=3)
    print("\nbefore `helm uninstall` (kind namespace/name):")
    print("\n".join(f"  {k} {n}/{m}" for k, n, m in sorted(before)))
    print("after:")
    print("\n".join(f"  {k} {n}/{m}" for k, n, m in sorted(after)))
    kept = {k for k in after if k[0] == "GPUMemoryEstimate"}
    assert kept == {("GPUMemoryEstimate", TENANT, g["metadata"]["name"]) for g in estimates}
    left = {k for k in after if (k[0], k[2]) not in EVERY_NAMESPACE} - THE_ADMINS - kept
    assert left == LEFT_BY_DESIGN, (
        f"left but not documented: {sorted(left - LEFT_BY_DESIGN)}; "
        f"documented but gone: {sorted(LEFT_BY_DESIGN - left)}")
    documented = section(OPERATIONS.read_text(), UNINSTALL)
    unnamed = sorted(k for k in left if f"`{k[2]}`" not in documented)
    assert not unnamed, f"left, but docs/operations.md ({UNINSTALL}) does not name it: {unnamed}"
    print("\nthe track as run (seconds):")
    for ran in track.ran:
        print(f"  {ran.seconds:7.1f}  {ran.command}")


def test_the_admin_commands_are_read_from_the_readme_with_continuations_joined() -> None:
    text = ("# x\n" + SECTION + "\n\nprose\n\n```sh\nhelm install a \\\n    --set b=c\n"
            "kubectl get job -w   # a comment\n```\n\n```sh\nnot this\n```\n## Next\n")
    assert admin_commands(text) == ["helm install a --set b=c",
                                    "kubectl get job -w   # a comment"]


def test_a_kubectl_table_is_cut_at_its_header_columns_so_empty_cells_stay_empty() -> None:
    watched = ("NAME         STATUS      COMPLETIONS   DURATION   AGE\n"
               "gpt-sample   Suspended   0/1                      1s\n"
               "gpt-sample   Running     0/1           0s         5s\n")
    assert [(r["NAME"], r["STATUS"], r["DURATION"]) for r in table(watched)] == [
        ("gpt-sample", "Suspended", ""), ("gpt-sample", "Running", "0s")]
