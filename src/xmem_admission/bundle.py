"""Build the probe bundle: the estimator package, copied alone into a user's container.

``python -m xmem_admission.bundle DIR`` writes ``DIR/sitecustomize.py`` (see
``estimator.probe.sitehook``) and ``DIR/xmem_admission/`` holding the package root and the two
packages the probe runs on: ``estimator`` (probe, trace, orchestration, allocator simulator,
estimate) and ``contract`` (GPU catalogue, termination message, probe environment, errors). A
module the estimator engineers add to those packages is carried along without anyone editing a
list. Every bundled module is checked against the wall as it is copied: it may import the
standard library, torch and the bundled packages only, because the user's image has nothing
else (import-linter keeps the same wall in the source tree; this check also covers a bundle
built from a modified copy).

The estimation pod's init container runs this with the controller's image and an emptyDir as
``DIR``; the training container then gets ``PYTHONPATH=DIR``. ``xmem estimate`` traces with the
same bundle (``cached()``: built once per content into the user's cache folder), so a local
estimate and an estimation pod run the same code beside the user's torch. Standard library only.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import sys
import tempfile
from typing import List, Optional, Sequence, Set

from xmem_admission.contract.errors import BundleError

PACKAGE = "xmem_admission"
# The packages copied into the bundle, beside the package root's ``__init__.py``.
BUNDLED = ("contract", "estimator")
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
    """The absolute module names a source file imports, anywhere in it (``from P import m``
    counts as ``P.m`` as well, since ``m`` may be a module)."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _inside_bundle(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 1 or parts[1] in BUNDLED or parts[1] == "__version__"


def _files(source: str) -> List[str]:
    """The bundled source files, relative to ``source`` (sorted)."""
    found = ["__init__.py"]
    for package in BUNDLED:
        root = os.path.join(source, package)
        if not os.path.isfile(os.path.join(root, "__init__.py")):
            raise BundleError(f"{PACKAGE}.{package} is part of the probe bundle but is not a "
                              f"package in {source}")
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found += [os.path.relpath(os.path.join(folder, n), source)
                      for n in names if n.endswith(".py")]
    return sorted(found)


def _module_name(relpath: str) -> str:
    parts = relpath[:-len(".py")].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE] + parts)


def modules(source: Optional[str] = None) -> List[str]:
    """The bundle's module names (sorted), each checked against the wall."""
    source = source or package_dir()
    names = []
    for relpath in _files(source):
        name = _module_name(relpath)
        for imported in sorted(_imports(os.path.join(source, relpath))):
            top = imported.split(".")[0]
            if top == PACKAGE:
                if not _inside_bundle(imported):
                    raise BundleError(f"{name} imports {imported!r}, which is not part of the "
                                      "probe bundle: the estimator never imports the cluster "
                                      "side or the commands")
            elif top not in ALLOWED_THIRD_PARTY and not _is_stdlib(top):
                raise BundleError(f"{name} imports {imported!r}, which a user's image does not "
                                  "have: the probe bundle may only use the standard library "
                                  "and torch")
        names.append(name)
    return names


def build(target: str, source: Optional[str] = None) -> List[str]:
    """Write the bundle into ``target`` (created if needed); returns the module names copied.

    Written into a temporary directory next to the target and moved into place, so a
    container that starts while the copy runs never sees half a bundle.
    """
    from xmem_admission.estimator.probe.sitehook import SITECUSTOMIZE

    source = source or package_dir()
    names = modules(source)
    try:
        os.makedirs(target, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".xmem-bundle-", dir=target)
        for relpath in _files(source):
            dest = os.path.join(staging, PACKAGE, relpath)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(os.path.join(source, relpath), dest)
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
    return names


CACHE_ENV = "XMEM_BUNDLE_CACHE"  # where ``cached()`` keeps bundles (default: the user's cache)


def cache_root() -> str:
    """``$XMEM_BUNDLE_CACHE``, else ``$XDG_CACHE_HOME/xmem-admission/bundle`` (``~/.cache``)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return os.path.abspath(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xmem-admission", "bundle")


def content_key(source: Optional[str] = None) -> str:
    """The package version and a digest of everything a bundle built from ``source`` holds (the
    bundled files' paths and bytes, and ``sitecustomize.py``): two sources with the same key
    build the same bundle."""
    from xmem_admission import __version__
    from xmem_admission.estimator.probe.sitehook import SITECUSTOMIZE

    source = source or package_dir()
    digest = hashlib.sha256()
    for relpath in _files(source):
        with open(os.path.join(source, relpath), "rb") as handle:
            data = handle.read()
        digest.update(f"{relpath}\0{len(data)}\0".encode())
        digest.update(data)
    digest.update(SITECUSTOMIZE.encode())
    return f"{__version__}-{digest.hexdigest()[:16]}"


def cached(root: Optional[str] = None, source: Optional[str] = None) -> str:
    """The bundle of this package, built on first use into ``root/KEY`` (``cache_root()``,
    ``content_key()``) and reused while the package's content stays the same; returns its
    folder. A bundle appears whole or not at all (built in a temporary folder and renamed into
    place), so concurrent first runs race harmlessly: the first rename wins."""
    root = root or cache_root()
    final = os.path.join(root, content_key(source))
    if os.path.isfile(os.path.join(final, "sitecustomize.py")):
        return final
    try:
        os.makedirs(root, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".build-", dir=root)
    except OSError as exc:
        raise BundleError(f"cannot create the probe bundle cache {root}: {exc} (set "
                          f"{CACHE_ENV} to a writable folder)") from None
    try:
        build(staging, source)
        try:
            os.rename(staging, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "sitecustomize.py")):
                raise
    except OSError as exc:
        raise BundleError(f"cannot write the probe bundle to {final}: {exc}") from None
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return final


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m xmem_admission.bundle DIR", file=sys.stderr)
        return 2
    try:
        names = build(args[0])
    except BundleError as exc:
        print(f"xmem bundle: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"xmem bundle: {len(names)} modules and sitecustomize.py written to {args[0]}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
