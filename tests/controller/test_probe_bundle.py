"""The probe bundle starts the probe from ``sitecustomize`` whatever the command looks like.

The bundle is built as the estimation pod's init container builds it; the training commands run
as subprocesses with only the bundle on ``PYTHONPATH`` and ``XMEM_PROBE=1``, exactly the
environment the controller gives the estimation container. The result file is what the kubelet
would put in the termination message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.controller.support import REPO, SCRIPTS, TINY_GPT
from xmem_admission import bundle
from xmem_admission.contract import termination
from xmem_admission.contract.errors import BundleError

PACKAGE = REPO / "src" / "xmem_admission"


def _tree(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                  if "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("bundle") / "probe"
    subprocess.run([sys.executable, "-m", "xmem_admission.bundle", str(target)], check=True)
    return target


def _run(built: Path, command: List[str], tmp: Path, **extra_env: str) -> Dict[str, Any]:
    result_path = tmp / "termination-log"
    env = {"PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"]),
           "HOME": str(tmp), "PYTHONPATH": str(built), "XMEM_PROBE": "1",
           "XMEM_PROBE_GPUS": "A100-80GB,H100-80GB", "XMEM_PROBE_STEPS": "2",
           "XMEM_PROBE_MODE": "auto", "XMEM_RESULT_PATH": str(result_path),
           "CUDA_VISIBLE_DEVICES": ""}
    env.update(extra_env)
    done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True, timeout=240)
    text = result_path.read_text() if result_path.exists() else ""
    return {"code": done.returncode, "output": done.stdout + done.stderr, "text": text,
            "result": termination.decode(text) if text else None}


def test_the_bundle_is_the_estimator_and_contract_packages_and_nothing_else(built):
    copied = _tree(built / "xmem_admission")
    expected = ["__init__.py"] + [f"{package}/{path}" for package in ("contract", "estimator")
                                  for path in _tree(PACKAGE / package)]
    assert copied == sorted(expected)
    assert {"estimator/probe/runner.py", "estimator/allocator/caching.py",
            "contract/gpus.py", "contract/termination.py"} <= set(copied)
    assert not any(path.startswith(("cluster/", "commands/")) for path in copied)
    assert (built / "sitecustomize.py").is_file()


@pytest.mark.parametrize("line, message", [
    ("import kubernetes  # a cluster-side dependency",
     "runner imports 'kubernetes', which a user's image does not have"),
    ("from xmem_admission.cluster import labels",
     "runner imports 'xmem_admission.cluster', which is not part of the probe bundle"),
], ids=["third-party", "cluster-side"])
def test_the_bundle_refuses_a_module_that_imports_what_user_images_lack(tmp_path, line, message):
    source = tmp_path / "pkg"
    shutil.copytree(PACKAGE, source)
    runner = source / "estimator" / "probe" / "runner.py"
    runner.write_text(runner.read_text() + f"\n{line}\n")
    with pytest.raises(BundleError, match=message):
        bundle.build(str(tmp_path / "out"), source=str(source))
    assert not (tmp_path / "out" / "xmem_admission").exists()


def test_python_from_the_bundle_is_the_bundled_package(built, tmp_path):
    env = {"PYTHONPATH": str(built), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", "import xmem_admission; print(xmem_admission.__file__)"],
                          env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(built / "xmem_admission" / "__init__.py")


def test_a_shell_pipeline_probes_the_training_script_and_stops_what_follows(built, tmp_path):
    prepared, uploaded = tmp_path / "prepared", tmp_path / "uploaded"
    shell = (f"cd {REPO / 'examples'} && python {SCRIPTS / 'prepare.py'} {prepared} && "
             f"python -u train_gpt.py {' '.join(TINY_GPT)} && "
             f"python {SCRIPTS / 'upload.py'} {uploaded}")
    run = _run(built, ["bash", "-c", shell], tmp_path)
    assert run["code"] == 0, run["output"]
    assert prepared.read_text() == "prepared\n"  # the step before training ran normally
    assert not uploaded.exists()  # nothing after the estimated training ran
    result = run["result"]
    assert result.ok and result.steps == 2
    assert [g["gpu"] for g in result.gpus] == ["A100-80GB", "H100-80GB"]
    assert all(g["total_bytes"] > g["peak_reserved_bytes"] > 0 for g in result.gpus)
    assert len(run["text"].encode()) <= termination.LIMIT_BYTES


def test_python_dash_m_is_probed_as_a_module(built, tmp_path):
    package = tmp_path / "trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    shutil.copy(REPO / "examples/train_gpt.py", package / "__main__.py")
    run = _run(built, [sys.executable, "-m", "trainer", *TINY_GPT], tmp_path)
    assert run["code"] == 0, run["output"]
    assert run["result"].ok


def test_a_script_failing_before_its_first_step_reports_its_traceback_and_exit_code(built, tmp_path):
    run = _run(built, [sys.executable, str(SCRIPTS / "fails_before_step.py")], tmp_path)
    assert run["code"] == 1
    result = run["result"]
    assert result.status == "script_error"
    assert "FileNotFoundError: no training shards under /data" in result.traceback
    assert "FileNotFoundError" in run["output"]  # and in the container's log, for the Event


@pytest.mark.parametrize("launcher", [
    ["torchrun", "--standalone", "--nproc-per-node", "1"],
    ["accelerate", "launch", "--num_processes", "1", "--num_machines", "1",
     "--mixed_precision", "no", "--dynamo_backend", "no"],
], ids=["torchrun", "accelerate"])
def test_a_launcher_with_one_process_has_its_worker_probed_not_itself(built, tmp_path, launcher):
    program = shutil.which(launcher[0], path=os.path.dirname(sys.executable))
    assert program is not None, f"{launcher[0]} is part of the test extra"
    run = _run(built, [program, *launcher[1:], str(REPO / "examples/train_gpt.py"), *TINY_GPT],
               tmp_path)
    assert run["code"] == 0, run["output"]
    assert run["result"].ok
    assert run["output"].count("xmem probe: tracing") == 1


def test_without_xmem_probe_the_bundle_changes_nothing(built, tmp_path):
    run = _run(built, [sys.executable, "-c", "print('plain')"], tmp_path, XMEM_PROBE="0")
    assert (run["code"], run["output"].strip(), run["text"]) == (0, "plain", "")


def test_the_bundle_can_be_rebuilt_in_place(built, tmp_path):
    target = tmp_path / "again"
    first = bundle.build(str(target))
    second = bundle.build(str(target))
    assert first == second
    assert sorted(os.listdir(target)) == ["sitecustomize.py", "xmem_admission"]


def test_on_python_3_9_without_a_stdlib_list_the_wall_is_checked_by_location(monkeypatch):
    expected = bundle.modules()
    monkeypatch.setattr(bundle, "_STDLIB", frozenset())  # sys.stdlib_module_names is 3.10+
    assert bundle.modules() == expected
    assert bundle._is_stdlib("argparse") and not bundle._is_stdlib("kubernetes")


def _torch_only_venv(root: Path) -> Path:
    """A virtual environment whose site-packages holds torch and what torch requires, nothing
    else: links to this interpreter's installed distributions, found through their metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    [site] = root.glob("lib/python*/site-packages")
    names, pending = set(), ["torch"]
    while pending:
        dist = metadata.distribution(pending.pop())
        name = dist.metadata["Name"].lower().replace("_", "-")
        if name in names:
            continue
        names.add(name)
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
        for entry in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            link = site / entry
            if not link.exists():
                link.symlink_to(Path(dist.locate_file(entry)))
    return root / "bin" / "python"


def test_a_bundle_copied_alone_runs_the_probe_where_only_torch_is_installed(tmp_path):
    python = _torch_only_venv(tmp_path / "venv")
    lacks = subprocess.run([str(python), "-c", "import kubernetes"], capture_output=True)
    assert lacks.returncode != 0  # the environment really lacks the cluster side's packages
    target = tmp_path / "empty" / "probe"
    target.parent.mkdir()
    bundle.build(str(target))
    workdir = tmp_path / "work"
    workdir.mkdir()
    shutil.copy(REPO / "examples/train_gpt.py", workdir / "train_gpt.py")
    run = _run(target, [str(python), "train_gpt.py", *TINY_GPT], workdir)
    assert run["code"] == 0, run["output"]
    result = run["result"]
    assert result.ok and result.steps == 2
    assert all(g["total_bytes"] > g["peak_reserved_bytes"] > 0 for g in result.gpus)


def _own_copy(built: Path, tmp_path: Path) -> Path:
    target = tmp_path / "probe"
    shutil.copytree(built, target)
    return target


IMAGE_PATH_SCRIPT = (
    "import json, os, subprocess, sys\n"
    "import from_the_image\n"
    "child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"PYTHONPATH\"])'],"
    " capture_output=True, text=True).stdout.strip()\n"
    "print(json.dumps({'path': sys.path, 'env': os.environ['PYTHONPATH'], 'child': child,"
    " 'module': from_the_image.__file__}))\n")


def test_the_images_own_pythonpath_follows_the_bundle_in_sys_path_and_child_processes(
        built, tmp_path):
    import json

    probe = _own_copy(built, tmp_path)
    lib, src = tmp_path / "image-lib", tmp_path / "image-src"
    lib.mkdir()
    src.mkdir()
    (src / "from_the_image.py").write_text("")
    # what the estimation pod's second init container records from the image's ENV
    (probe / "image-env.json").write_text(json.dumps({"PYTHONPATH": f"{lib}:{src}"}))
    run = _run(probe, [sys.executable, "-c", IMAGE_PATH_SCRIPT], tmp_path)
    assert run["code"] == 0, run["output"]
    seen = json.loads(run["output"].strip().splitlines()[-1])
    at = seen["path"].index(str(probe))
    assert seen["path"][at:at + 3] == [str(probe), str(lib), str(src)]
    assert seen["env"] == seen["child"] == f"{probe}:{lib}:{src}"
    assert seen["module"] == str(src / "from_the_image.py")


def test_an_image_without_pythonpath_leaves_the_path_as_the_pod_spec_made_it(built, tmp_path):
    probe = _own_copy(built, tmp_path)
    (probe / "image-env.json").write_text('{"PYTHONPATH": null}')
    run = _run(probe, [sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"],
               tmp_path)
    assert (run["code"], run["output"].strip()) == (0, str(probe))


def test_an_unusable_home_and_tmp_are_replaced_by_the_pods_scratch_folder(built, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    script = ("import os, tempfile; print(os.environ['HOME'], tempfile.gettempdir(), "
              "os.environ.get('XDG_CACHE_HOME', '-'))")
    run = _run(built, [sys.executable, "-c", script], tmp_path, HOME="/nonexistent",
               TMPDIR="/nonexistent/tmp", XMEM_PROBE_SCRATCH=str(scratch))
    assert run["code"] == 0, run["output"]
    assert run["output"].split() == [str(scratch), str(scratch / "tmp"), "-"]
    # usable ones are the image's and stay
    kept = _run(built, [sys.executable, "-c", script], tmp_path,
                XMEM_PROBE_SCRATCH=str(scratch))
    assert kept["output"].split()[0] == str(tmp_path)


def test_an_image_whose_python_has_no_torch_ends_with_that_reason(built, tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                   check=True)
    shutil.copy(REPO / "examples/train_gpt.py", tmp_path / "train_gpt.py")
    run = _run(built, [str(tmp_path / "venv/bin/python"), "train_gpt.py", *TINY_GPT], tmp_path)
    assert run["code"] == 1
    result = run["result"]
    assert result.status == "no_torch"
    assert "cannot import torch: No module named 'torch'" in result.reason
    assert str(tmp_path / "venv/bin/python") in result.reason
