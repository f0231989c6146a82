"""Small builders for the API-server contract tests (plain dicts, as a client sends them)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional


def job(name: str, labels: Optional[Dict[str, str]] = None, suspend: bool = False) -> Dict[str, Any]:
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"suspend": suspend, "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "busybox:1.36", "command": ["true"]}]}}},
    }


def pod(name: str, command: List[str], labels: Optional[Dict[str, str]] = None,
        **spec: Any) -> Dict[str, Any]:
    container: Dict[str, Any] = {"name": "main", "image": "busybox:1.36", "command": command}
    container.update(spec.pop("container", {}))
    body: Dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": body}


def raw(response: Any) -> Dict[str, Any]:
    """The JSON of a ``_preload_content=False`` answer."""
    return json.loads(response.data)


def status_of(exc: Any) -> Dict[str, Any]:
    return json.loads(exc.body)
