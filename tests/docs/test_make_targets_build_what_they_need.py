"""Every make target the docs name exists, and the ones that run a cluster build what it needs on
a clone where only `make demo` ran: helm and kubectl (`cli-tools`), the control plane and the
training stack's CRDs, which every localkube cluster serves. Read with `make -n`, which prints
the recipes in order and runs none of them."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import List

import pytest

from tests.docs import docs_truth

ROOT = docs_truth.ROOT
# What a localkube cluster (localkube/cluster.py: `helm template`, the training stack's CRDs, the
# real control plane) needs built, as the Makefile builds it.
CLUSTER_NEEDS = ("scripts/install-tools.sh", "scripts/build-kube.sh", "scripts/build-trainer.sh")


def _targets() -> List[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return re.findall(r"^([a-z][\w-]*):(?!=)", text, flags=re.MULTILINE)


def _dry_run(target: str) -> List[str]:
    if shutil.which("make") is None:
        pytest.fail("make is not installed: the Makefile cannot be read with `make -n`")
    done = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT), target,
                           "STAMP=/nonexistent/xmem-demo-ran"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_every_make_target_the_docs_name_is_in_the_makefile() -> None:
    named = {(page.path, word) for page in docs_truth.pages()
             for snippet in docs_truth.code_snippets(page.text)
             for word in re.findall(r"(?:^|[;&|(]\s*|sudo\s+)make\s+([a-z][\w-]*)", snippet)}
    assert {w for _, w in named} >= {"demo", "test", "tools", "node-test"}  # the scan finds them
    missing = sorted(f"{path}: make {word}" for path, word in named if word not in _targets())
    assert not missing, "named in the docs, no such Makefile target:\n" + "\n".join(missing)


@pytest.mark.parametrize("target,runs", [("node-test", "pytest -q -s tests/realnode"),
                                         ("node-bench", "bench/cluster/realnode_release.py"),
                                         ("playground", "localkube.playground up")])
def test_a_target_that_runs_a_cluster_builds_helm_and_the_cluster_first(target: str,
                                                                        runs: str) -> None:
    lines = _dry_run(target)
    ran = next(i for i, line in enumerate(lines) if runs in line)
    for need in CLUSTER_NEEDS:
        built = [i for i, line in enumerate(lines) if need in line]
        assert built and built[0] < ran, f"`make {target}` runs {runs} without {need} first"


def test_kube_up_builds_the_control_plane_it_starts() -> None:
    lines = _dry_run("kube-up")
    assert [line for line in lines if "build-kube.sh" in line or "kube.sh up" in line][:2] == [
        "bash scripts/build-kube.sh", "bash scripts/kube.sh up /tmp/xmem-kube"]
