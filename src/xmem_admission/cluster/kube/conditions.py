"""``metav1.Condition`` lists as the controller writes them on its own kinds.

A condition is ``{type, status, reason, message, observedGeneration, lastTransitionTime}``;
``lastTransitionTime`` moves only when the condition's status changes (``merged``), so
``kubectl wait --for=condition=...`` and an admin's "since when" both read it as Kubernetes'
own controllers write it.
"""

from __future__ import annotations

from typing import Any, Dict, List


def merged(old: Any, new: List[Dict[str, Any]], stamp: str) -> List[Dict[str, Any]]:
    """``new`` with each condition's lastTransitionTime kept where its status did not change."""
    before = {c.get("type"): c for c in old if isinstance(c, dict)} if isinstance(old, list) \
        else {}
    out = []
    for condition in new:
        prior = before.get(condition["type"])
        same = prior is not None and prior.get("status") == condition["status"] and \
            isinstance(prior.get("lastTransitionTime"), str)
        out.append(dict(condition, lastTransitionTime=prior["lastTransitionTime"] if same
                        and prior is not None else stamp))
    return out


def without_times(conditions: Any) -> List[Dict[str, Any]]:
    """The conditions as compared for a change: all but their lastTransitionTime."""
    if not isinstance(conditions, list):
        return []
    return [{k: v for k, v in c.items() if k != "lastTransitionTime"}
            for c in conditions if isinstance(c, dict)]
