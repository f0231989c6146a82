"""The simulator and the contract run inside users' images (Python >= 3.9, standard library
only): every module of ``estimator/allocator``, the trace format and ``contract`` parses as 3.9
and imports nothing but the standard library and those same modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import xmem_admission

PACKAGE = Path(xmem_admission.__file__).parent
FILES = sorted([*(PACKAGE / "estimator" / "allocator").glob("*.py"),
                PACKAGE / "estimator" / "trace.py", *(PACKAGE / "contract").glob("*.py")])
STDLIB = set(getattr(sys, "stdlib_module_names", ())) | {"__future__"}
# What a standard-library-only module may import of the package itself.
OWN = ("xmem_admission.estimator.allocator", "xmem_admission.estimator.trace",
       "xmem_admission.contract")


def test_the_list_covers_the_allocator_package():
    assert {p.stem for p in FILES} >= {"caching", "segments", "expandable", "cache_release",
                                       "statistics", "alloc_conf", "simulate", "snapshot",
                                       "trace", "gpus", "errors", "termination", "probe_env"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_module_parses_as_python_3_9_and_imports_only_the_standard_library(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), feature_version=(3, 9))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "xmem_admission":
                assert name.startswith(OWN), f"{path.name} imports {name}"
            else:
                assert name.split(".")[0] in STDLIB, f"{path.name} imports {name}"
