"""From `kubectl apply` of a Job to its release, with the estimation pod on a real kubelet.

The project on a real node (``tests/realnode/node_cluster.py``: the real control plane, the
kubelet of the pinned release with containerd 2.x and runc, a local registry requiring
authentication, kwok GPU nodes, ``xmem serve`` and ``xmem controller``): Jobs running the example
GPT script from a training image (Debian's Python 3.13, torch 2.15 from PyPI) are applied one
after another and the time between what a user would see is measured by watching the API
server every 0.2 s:

- controller: the Job applied (held by the webhook at CREATE) until its estimation pod exists;
- scheduling: until the pod is bound to the real node;
- probe image: until the init container from the project's image (the pod's sandbox, its image
  pulled, the probe bundle written) has ended;
- training image: until the init container from the training image (that image pulled, the
  image's PYTHONPATH read) has ended;
- probe: until the training container has ended (Python and torch start, the traced steps, the
  simulation, the result written);
- release: until the Job is unsuspended (the kubelet's status, the controller's estimate, the
  Job's patch).

The first Job pulls both images into containerd (cold); the later ones (other model sizes, so
each is estimated) find them there (warm). The kubelet's own pull times ("Successfully pulled
image ... in Ns") are printed beside. Needs root and the real node's tools, as
`make node-test` does: `sudo .venv/bin/python bench/cluster/realnode_release.py [--jobs 3]`.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from localkube import images, kubelet  # noqa: E402
from tests.e2e_real.support import TINY_GPT, job  # noqa: E402
from tests.realnode.node_cluster import (  # noqa: E402
    NodeCluster,
    container_statuses,
    estimate_of,
    estimation_pod,
    in_image,
)
from xmem_admission.cluster.controller import podspec  # noqa: E402

STEPS = ("controller", "scheduling", "probe image", "training image", "probe", "release")
PULLED = re.compile(r'Successfully pulled image "([^"]+)" in ([0-9.]+m?s)')


def _script(*argv: str) -> str:
    done = subprocess.run(["bash", *argv], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def _ended(pod: Dict[str, Any], name: str) -> bool:
    state = container_statuses(pod).get(name, {}).get("state") or {}
    return "terminated" in state


def _measure(on_node: NodeCluster, namespace: str, name: str, hidden: int) -> Dict[str, Any]:
    cluster = on_node.cluster
    args = [a if a != "64" else str(hidden) for a in TINY_GPT]
    workload = in_image(job(name, namespace), on_node.pushed["train"], None, args)
    def pod() -> Dict[str, Any]:
        gme = estimate_of(cluster, namespace, "Job", name)
        return estimation_pod(cluster, namespace, gme) if gme else {}

    checks: List[Callable[[], bool]] = [
        lambda: bool(pod()),
        lambda: bool(pod().get("spec", {}).get("nodeName")),
        lambda: _ended(pod(), podspec.INIT_NAME),
        lambda: _ended(pod(), podspec.IMAGE_ENV_NAME),
        lambda: _ended(pod(), "train"),
        lambda: not (cluster.get("batch/v1", "Job", name, namespace) or {}).get(
            "spec", {}).get("suspend", True),
    ]
    began = time.monotonic()
    cluster.apply(workload)
    times: List[float] = []
    for step, check in zip(STEPS, checks):
        deadline = time.monotonic() + 900
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: no {step} within 900 s")
            time.sleep(0.2)
        times.append(time.monotonic())
    marks = [began] + times
    split = {step: marks[i + 1] - marks[i] for i, step in enumerate(STEPS)}
    pulls = {}
    for event in cluster.list("v1", "Event", namespace):
        found = PULLED.search(event.get("message") or "")
        if found and event["involvedObject"]["name"] == pod()["metadata"]["name"]:
            pulls[found.group(1).rsplit("/", 1)[-1]] = found.group(2)
    gme = estimate_of(cluster, namespace, "Job", name)
    return {"split": split, "total": marks[-1] - began, "pulls": pulls,
            "phase": gme["status"]["phase"]}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3, help="Jobs, one after another")
    parser.add_argument("--torch", default="2.15.0")
    parser.add_argument("--python", default="3.13")
    options = parser.parse_args(argv)
    reason = kubelet.missing()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    base = _script("scripts/base-image.sh", "bookworm")
    context = Path(tempfile.mkdtemp(prefix="xmem-bench-context-"))
    try:
        probe = images.project_image(context)
    finally:
        shutil.rmtree(context, ignore_errors=True)
    train = images.training_image(options.torch, options.python)
    with tempfile.TemporaryDirectory(prefix="xmem-bench-node-") as root:
        on_node = NodeCluster(Path(root), kubelet.pause_image(base), probe,
                              {"train": train}).start()
        try:
            versions = on_node.node.versions()
            print(f"node: {versions}")
            for role, seconds in on_node.push_seconds.items():
                print(f"pushed {role} ({images.SIZES.get(probe if role == 'probe' else train, 0) / 1e6:.0f} MB "
                      f"in podman) into the registry in {seconds:.0f} s")
            tenant = on_node.namespace("bench")
            print("| job | " + " | ".join(STEPS) + " | total | kubelet's pulls |")
            print("|---|" + "---:|" * (len(STEPS) + 1) + "---|")
            for i in range(options.jobs):
                got = _measure(on_node, tenant.name, f"job-{i}", 64 + 32 * i)
                cells = " | ".join(f"{got['split'][s]:.1f}" for s in STEPS)
                pulls = ", ".join(f"{k} {v}" for k, v in sorted(got["pulls"].items()))
                print(f"| {i} ({'cold' if i == 0 else 'warm'}, {got['phase']}) | {cells} | "
                      f"{got['total']:.1f} | {pulls} |", flush=True)
        finally:
            on_node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
