"""The image (Dockerfile) without a Docker engine: its shape is parsed and linted (hadolint), and
what it runs is run here the way the image runs it: the cluster side with torch made
unimportable, and the probe bundle built by the very command the Dockerfile and the estimation
pod's init container use."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from tests.helm.chart import ROOT, VALUE_SETS, find, render, run, tool

DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> List[Tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: List[Tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _final_stage() -> List[Tuple[str, str]]:
    instructions = _instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def test_the_image_is_multi_stage_and_the_runtime_has_no_build_steps() -> None:
    froms = [args for word, args in _instructions() if word == "FROM"]
    assert len(froms) >= 2
    assert froms[-1].endswith("AS runtime")
    runtime = _final_stage()
    runs = " ".join(args for word, args in runtime if word == "RUN")
    assert "pip" not in runs and "apt-get" not in runs, "installs belong in the build stage"
    copies = [args for word, args in runtime if word == "COPY"]
    assert copies and all(c.startswith("--from=build") for c in copies)


def test_the_runtime_runs_as_the_chart_user_not_root() -> None:
    users = [args for word, args in _final_stage() if word == "USER"]
    assert users, "no USER in the runtime stage"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so runAsNonRoot can check it"
    pod = render(VALUE_SETS["everything"])
    for deployment in find(pod, "Deployment"):
        context = deployment["spec"]["template"]["spec"]["securityContext"]
        assert context["runAsUser"] == int(uid) and context["runAsGroup"] == int(gid)


def test_the_image_installs_the_server_extra_and_never_torch() -> None:
    instructions = _instructions()
    runs = [args for word, args in instructions if word == "RUN"]
    assert any('pip install ".[server]"' in r for r in runs)
    text = " ".join(args for _, args in instructions).lower()
    assert "torch" not in text and "[estimator]" not in text and "[dev]" not in text
    entrypoint = [args for word, args in _final_stage() if word == "ENTRYPOINT"]
    assert entrypoint == ['["xmem"]']


def test_the_image_builds_the_probe_bundle_the_controller_copies() -> None:
    from xmem_admission.cluster.controller import podspec

    runs = [shlex.split(args) for word, args in _instructions() if word == "RUN"]
    bundle = [r for r in runs if "xmem_admission.bundle" in r]
    assert bundle, "the probe bundle is not built"
    # The init container of every estimation pod runs the same module from this image.
    init_command = ["python", "-m", "xmem_admission.bundle", podspec.PROBE_DIR]
    assert bundle[0][1:3] == init_command[1:3]


def test_hadolint_finds_nothing_to_fix() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    binary = str(hadolint) if hadolint.exists() else tool("hadolint")
    result = run([binary, "--no-color", str(DOCKERFILE)], check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_sends_only_what_the_build_copies() -> None:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for word, args in _instructions():
        if word == "COPY" and not args.startswith("--from"):
            copied.update(p.rstrip("/") for p in args.split()[:-1])
    assert copied == allowed


# The cluster side of the image, with torch made unimportable: every module of the cluster
# package, the bundle builder and the command line are imported (import-linter checks the same
# wall statically; this is what the image itself would do).
NO_TORCH = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'torchvision', 'transformers'):
            raise ImportError('no torch in the xmem-admission image: ' + name)
sys.meta_path.insert(0, Refuse())
import importlib, pkgutil
import xmem_admission.bundle, xmem_admission.cluster
imported = [info.name for info in pkgutil.walk_packages(xmem_admission.cluster.__path__,
                                                        'xmem_admission.cluster.')]
for name in imported:
    importlib.import_module(name)
assert 'xmem_admission.cluster.controller.manager' in imported, imported
from xmem_admission.cli import main
sys.argv = ['xmem', '--help']
main()
"""


def test_the_webhook_and_controller_code_runs_without_torch() -> None:
    result = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "serve" in result.stdout


def test_the_bundle_command_writes_a_bundle_without_the_cluster_side(tmp_path: Path) -> None:
    target = tmp_path / "probe"
    run([sys.executable, "-m", "xmem_admission.bundle", str(target)])
    assert (target / "sitecustomize.py").is_file()
    package = target / "xmem_admission"
    assert sorted(p.name for p in package.iterdir() if p.name != "__pycache__") == [
        "__init__.py", "contract", "estimator"]
    assert (package / "estimator" / "probe" / "runner.py").is_file()


@pytest.fixture(autouse=True)
def _dockerfile_exists() -> None:
    assert DOCKERFILE.is_file()
