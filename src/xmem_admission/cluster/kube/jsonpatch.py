"""Copy-on-write drafts of JSON objects and an exact RFC 6902 diff between two versions.

The webhook mutates a plain object and derives the JSONPatch by diffing the object before and
after (HAMi's way, and the only way to be sure the patch says exactly what the mutation did).
Deep-copying a 20 KB Job and diffing every field costs more than the rest of the admission, so:

- ``Draft`` shares every subtree with the original and copies a dict or list only when a write
  goes through it (copy-on-write along the written path). The original is never modified, so
  the mutation stays a pure function of its input.
- ``diff`` skips any pair of subtrees that are the same object, so it only walks the paths that
  were written. On a fully copied pair it is still exact, just slower.

Lists are diffed element by element over their common length, then the tail is added or removed
(from the end, so every index stays valid while the patch is applied in order).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Union

from xmem_admission.contract.errors import InvalidObjectError

PathElement = Union[str, int]
Path = Sequence[PathElement]
Operation = Dict[str, Any]

_MISSING = object()


def escape(token: str) -> str:
    """One JSON-pointer reference token (RFC 6901): "~" becomes "~0" and "/" becomes "~1"."""
    return token.replace("~", "~0").replace("/", "~1")


def pointer(path: Path) -> str:
    """A JSON pointer for a path of keys and indices."""
    return "".join("/" + escape(str(part)) for part in path)


def dotted(path: Path) -> str:
    """A path as Kubernetes field paths read: ``spec.containers[0].resources.limits[nvidia.com/gpu]``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "." in part or "/" in part:
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


class Draft:
    """A writable view of a JSON object that copies only what it writes.

    Reads (``get``) see the current state; writes (``set``, ``delete``, ``container``) copy each
    dict or list on the path the first time it is written through, so the original object and
    every subtree not written stay untouched and shared.
    """

    def __init__(self, original: Dict[str, Any]):
        self.original = original
        self.root: Dict[str, Any] = dict(original)
        # Strong references keep ids unique for the draft's lifetime.
        self._owned: Dict[int, Any] = {id(self.root): self.root}

    def get(self, path: Path, default: Any = None) -> Any:
        """The value at ``path`` in the draft, or ``default`` when any step is missing."""
        node: Any = self.root
        for part in path:
            if isinstance(node, dict) and isinstance(part, str):
                node = node.get(part, _MISSING)
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                node = node[part]
            else:
                return default
            if node is _MISSING:
                return default
        return node

    def _own(self, value: Any) -> Any:
        if id(value) in self._owned:
            return value
        copy = dict(value) if isinstance(value, dict) else list(value)
        self._owned[id(copy)] = copy
        return copy

    def container(self, path: Path) -> Any:
        """The dict or list at ``path``, made writable; missing dicts on the way are created.

        Raises ``InvalidObjectError`` when something on the path exists but is not a container
        (a label map that is a string, say): the object cannot be what its kind says.
        """
        node: Any = self.root
        for depth, part in enumerate(path):
            if isinstance(node, dict) and isinstance(part, str):
                child = node.get(part)
                if child is None:
                    child = {}
                    self._owned[id(child)] = child
                elif isinstance(child, (dict, list)):
                    child = self._own(child)
                else:
                    raise InvalidObjectError(
                        f"{dotted(path[: depth + 1])}: expected an object, got {type(child).__name__}"
                    )
                node[part] = child
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                child = node[part]
                if not isinstance(child, (dict, list)):
                    raise InvalidObjectError(
                        f"{dotted(path[: depth + 1])}: expected an object, got {type(child).__name__}"
                    )
                child = self._own(child)
                node[part] = child
            else:
                raise InvalidObjectError(f"{dotted(path[: depth + 1])}: cannot be written")
            node = child
        return node

    def set(self, path: Path, value: Any) -> None:
        """Set the value at ``path`` (its parent dicts are created when missing)."""
        parent = self.container(path[:-1])
        parent[path[-1]] = value

    def delete(self, path: Path) -> None:
        """Remove the key at ``path`` if present; a missing key is not an error."""
        if self.get(path, _MISSING) is _MISSING:
            return
        parent = self.container(path[:-1])
        del parent[path[-1]]


def _same_scalar(a: Any, b: Any) -> bool:
    # JSON true and 1 are different values even though Python finds them equal.
    return type(a) is type(b) and a == b


def _diff(a: Any, b: Any, path: str, ops: List[Operation]) -> None:
    if a is b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key, old in a.items():
            where = path + "/" + escape(key)
            new = b.get(key, _MISSING)
            if new is _MISSING:
                ops.append({"op": "remove", "path": where})
            elif new is not old:
                _diff(old, new, where, ops)
        for key, new in b.items():
            if key not in a:
                ops.append({"op": "add", "path": path + "/" + escape(key), "value": new})
        return
    if isinstance(a, list) and isinstance(b, list):
        common = min(len(a), len(b))
        for index in range(common):
            if a[index] is not b[index]:
                _diff(a[index], b[index], f"{path}/{index}", ops)
        for index in range(common, len(b)):
            ops.append({"op": "add", "path": f"{path}/{index}", "value": b[index]})
        for index in range(len(a) - 1, common - 1, -1):
            ops.append({"op": "remove", "path": f"{path}/{index}"})
        return
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)) or not _same_scalar(a, b):
        ops.append({"op": "replace", "path": path, "value": b})


def diff(before: Any, after: Any) -> List[Operation]:
    """RFC 6902 operations that turn ``before`` into ``after``; empty when they are equal."""
    ops: List[Operation] = []
    _diff(before, after, "", ops)
    return ops
