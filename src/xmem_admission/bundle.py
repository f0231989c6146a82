"""Build the probe bundle: the pure-Python estimator, copied alone into a user's container.

``python -m xmem_admission.bundle DIR`` writes ``DIR/sitecustomize.py`` (see ``sitehook``) and
``DIR/xmem_admission/`` holding exactly the modules the probe needs: the import closure of
``sitehook`` (probe, tracker, virtual CUDA and patches, trace, orchestration, allocator
simulator, GPU catalogue, errors, termination message...), found by reading their imports, so a
module the estimator engineers add is carried along without anyone editing a list. The closure
must stay on the estimator's side of the house: a module that imports anything but the standard
library and torch (kubernetes, fastapi, yaml) makes the build fail, because the user's image
has none of those.

The estimation pod's init container runs this with the controller's image and an emptyDir as
``DIR``; the training container then gets ``PYTHONPATH=DIR``. Standard library only.
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Set

from xmem_admission.errors import BundleError

PACKAGE = "xmem_admission"
ROOTS = ("sitehook",)
# Third-party top-level modules a bundle module may import (the user's image has them).
ALLOWED_THIRD_PARTY = frozenset({"torch", "typing_extensions"})
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))  # Python 3.10+


def _is_stdlib(name: str) -> bool:
    """Whether a top-level module ships with Python (by list on 3.10+, by location on 3.9)."""
    if _STDLIB:
        return name in _STDLIB
    import importlib.util
    import sysconfig

    if name in sys.builtin_module_names:
        return True
    spec = importlib.util.find_spec(name)
    origin = (spec.origin or "") if spec is not None else ""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    return origin in ("built-in", "frozen") or (
        any(origin.startswith(r) for r in roots) and "site-packages" not in origin)


def package_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def _imports(path: str) -> Set[str]:
    """Top-level names and ``xmem_admission.X`` submodules a source file imports (anywhere)."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            if node.module == PACKAGE:
                out.update(f"{PACKAGE}.{alias.name}" for alias in node.names)
    return out


def closure(roots: Sequence[str] = ROOTS, source: Optional[str] = None) -> List[str]:
    """The modules of the package the roots need, transitively (sorted); checks the wall."""
    source = source or package_dir()
    seen: Dict[str, str] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        path = os.path.join(source, f"{name}.py")
        if not os.path.isfile(path):
            raise BundleError(f"{PACKAGE}.{name} is imported by the probe bundle but is not a "
                              f"single module in {source}")
        seen[name] = path
        for imported in _imports(path):
            top = imported.split(".")[0]
            if top == PACKAGE:
                parts = imported.split(".")
                if len(parts) >= 2:
                    pending.append(parts[1])
            elif top not in ALLOWED_THIRD_PARTY and not _is_stdlib(top):
                raise BundleError(f"{PACKAGE}.{name} imports {imported!r}, which a user's image "
                                  "does not have: the probe bundle may only use the standard "
                                  "library and torch")
    return sorted(seen)


def build(target: str, source: Optional[str] = None) -> List[str]:
    """Write the bundle into ``target`` (created if needed); returns the module names copied.

    Written into a temporary directory next to the target and moved into place, so a
    container that starts while the copy runs never sees half a bundle.
    """
    from xmem_admission.sitehook import SITECUSTOMIZE

    source = source or package_dir()
    modules = closure(source=source)
    try:
        os.makedirs(target, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".xmem-bundle-", dir=target)
        package = os.path.join(staging, PACKAGE)
        os.makedirs(package)
        shutil.copyfile(os.path.join(source, "__init__.py"), os.path.join(package, "__init__.py"))
        for name in modules:
            shutil.copyfile(os.path.join(source, f"{name}.py"), os.path.join(package, f"{name}.py"))
        with open(os.path.join(staging, "sitecustomize.py"), "w", encoding="utf-8") as handle:
            handle.write(SITECUSTOMIZE)
        for entry in (PACKAGE, "sitecustomize.py"):
            final = os.path.join(target, entry)
            if os.path.isdir(final):
                shutil.rmtree(final)
            elif os.path.exists(final):
                os.remove(final)
            os.replace(os.path.join(staging, entry), final)
        os.rmdir(staging)
    except OSError as exc:
        raise BundleError(f"cannot write the probe bundle to {target}: {exc}") from None
    return modules


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m xmem_admission.bundle DIR", file=sys.stderr)
        return 2
    try:
        modules = build(args[0])
    except BundleError as exc:
        print(f"xmem bundle: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"xmem bundle: {len(modules)} modules and sitecustomize.py written to {args[0]}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
