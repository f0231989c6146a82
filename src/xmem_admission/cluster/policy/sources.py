"""Where the policy comes from: a fixed object, a YAML file, or the cluster's GPUAdmissionPolicy.

The webhook asks ``current()`` on every review (a plain attribute read); ``refresh()`` does the
slow part (a stat, a read, an API call) and is called by the server's periodic task, off the
event loop. A policy that fails to (re)load never replaces a good one: the last good policy
stays in force, the error is kept for ``/readyz`` and counted as a policy error.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional, Protocol, Tuple

from xmem_admission.cluster.policy.model import API_GROUP, API_VERSION, DEFAULT_NAME, PLURAL, Policy
from xmem_admission.contract.errors import PolicyError

log = logging.getLogger(__name__)

ErrorHook = Callable[[str], None]  # called with a reason label on every failed (re)load


class PolicySource(Protocol):
    """Anything that can say which policy is in force."""

    def current(self) -> Optional[Policy]:
        """The policy in force, or None when none was ever loaded."""

    def refresh(self) -> None:
        """Reload if the source changed (may block; never raises)."""

    @property
    def error(self) -> Optional[str]:
        """Why the last (re)load failed, or None."""


class _Held:
    """The part every source shares: the policy in force and the last load error."""

    _policy: Optional[Policy] = None
    _error: Optional[str] = None

    def current(self) -> Optional[Policy]:
        return self._policy

    @property
    def error(self) -> Optional[str]:
        return self._error


class StaticPolicySource(_Held):
    """A policy given once (tests, embedding)."""

    def __init__(self, policy: Policy):
        self._policy = policy

    def refresh(self) -> None:
        return None


def _stamp(path: str) -> Tuple[int, int, int]:
    info = os.stat(path)  # follows symlinks: ConfigMap mounts swap a ..data link
    return (info.st_mtime_ns, info.st_size, info.st_ino)


class FilePolicySource(_Held):
    """A ``GPUAdmissionPolicy`` in a YAML file, reloaded when the file changes."""

    def __init__(self, path: str, on_error: Optional[ErrorHook] = None):
        self.path = path
        self.on_error = on_error
        self._error: Optional[str] = None
        self._stamp = _stamp_or_none(path)
        self._policy = Policy.from_file(path)  # a bad file at startup is a startup error

    def refresh(self) -> None:
        stamp = _stamp_or_none(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._policy = Policy.from_file(self.path)
            self._error = None
            log.info("policy reloaded from %s", self.path)
        except PolicyError as exc:
            self._error = str(exc)
            log.error("policy reload failed, keeping the previous one: %s", exc)
            if self.on_error is not None:
                self.on_error("reload")


def _stamp_or_none(path: str) -> Optional[Tuple[int, int, int]]:
    try:
        return _stamp(path)
    except OSError:
        return None


class ClusterPolicySource(_Held):
    """The cluster-scoped ``GPUAdmissionPolicy`` named ``name``, read with the official client.

    ``api_client`` is a ``kubernetes.client.ApiClient`` (in-cluster or kubeconfig credentials).
    Read by polling rather than a watch: one small GET every few seconds costs nothing and has no
    reconnect logic to get wrong; a change takes effect within one refresh period.
    """

    def __init__(self, api_client: Any, name: str = DEFAULT_NAME, on_error: Optional[ErrorHook] = None):
        from kubernetes import client  # server extra; imported where used

        self.name = name
        self.on_error = on_error
        self._api = client.CustomObjectsApi(api_client)
        self._policy: Optional[Policy] = None
        self._version: Optional[str] = None
        self._error: Optional[str] = "not loaded yet"
        # The object last read and what its parse said: (uid, generation, the parser's error or
        # None), for the controller's status conditions (``controller.policy_status``).
        self.seen: Optional[Tuple[str, int, Optional[str]]] = None
        self.written: Optional[Tuple[Any, ...]] = None  # the verdict the controller last wrote

    def refresh(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            # The client declares ``object``: a custom object's GET answers a JSON object (a dict).
            obj: Any = self._api.get_cluster_custom_object(
                API_GROUP, API_VERSION, PLURAL, self.name)
        except ApiException as exc:
            what = "not found" if exc.status == 404 else f"HTTP {exc.status} {exc.reason}"
            self._fail("fetch", f"GPUAdmissionPolicy {self.name!r}: {what}")
            return
        except Exception as exc:  # connection refused, TLS, timeouts: keep the last policy
            self._fail("fetch", f"GPUAdmissionPolicy {self.name!r}: {type(exc).__name__}: {exc}")
            return
        meta = obj.get("metadata") or {}
        version = meta.get("resourceVersion")
        if version is not None and version == self._version and self._policy is not None:
            return
        seen = (str(meta.get("uid", "")), int(meta.get("generation") or 0))
        try:
            self._policy = Policy.from_object(obj)
        except PolicyError as exc:
            self.seen = seen + (str(exc),)
            self._fail("invalid", f"GPUAdmissionPolicy {self.name!r}: {exc}")
            return
        self.seen = seen + (None,)
        self._version = version
        self._error = None
        log.info("policy %s loaded (resourceVersion %s)", self.name, version)

    def _fail(self, reason: str, message: str) -> None:
        if message != self._error:
            log.error("%s", message)
        self._error = message
        if self.on_error is not None:
            self.on_error(reason)
