"""The simulator runs inside users' images (Python >= 3.9, standard library only)."""

from __future__ import annotations

import ast
import os
import sys

import pytest

import xmem_admission

MODULES = ["alloc_conf", "allocator", "allocator_stats", "segments", "release", "expandable",
           "simulate", "snapshot"]
PACKAGE = os.path.dirname(xmem_admission.__file__)
STDLIB = set(getattr(sys, "stdlib_module_names", ())) | {"__future__"}


@pytest.mark.parametrize("name", MODULES)
def test_the_module_parses_as_python_3_9_and_imports_only_the_standard_library(name):
    with open(os.path.join(PACKAGE, name + ".py"), encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), feature_version=(3, 9))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots = [(node.module or "").split(".")[0]]
        else:
            continue
        for root in roots:
            assert root in STDLIB or root == "xmem_admission", f"{name} imports {root}"
