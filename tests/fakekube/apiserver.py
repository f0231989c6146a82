"""A stand-in Kubernetes API server on loopback: the real REST paths, over HTTPS, with watches.

``ApiServer().start()`` listens on 127.0.0.1 (HTTPS with a throw-away CA from ``trustme``,
bearer-token authentication) and serves what the official ``kubernetes`` client and kubectl
ask for: discovery (``/api``, ``/apis``, ``/version``), and for every registered kind
``/api/v1/...`` or ``/apis/{group}/{version}/...`` collections and objects, cluster-wide or per
namespace, with the ``status``, ``log`` and ``binding`` subresources. Lists honour
``labelSelector``, ``fieldSelector``, ``limit`` and ``continue``; ``?watch=true`` streams
chunked JSON events from a ``resourceVersion`` (410 Gone when it is older than the history),
with the synthetic ADDED events of a fresh watch, DELETED/ADDED when an object leaves or enters
a selector, ``timeoutSeconds`` and ``allowWatchBookmarks``.

Users: each bearer token names a user (``add_user``; the server's own token is a superuser);
requests are authorized by the stored RBAC objects (``rbac``), and the requester is the
``userInfo`` the admission webhooks see.

Fault injection: ``server.faults.add(status=429, method="PATCH", path="/jobs/")`` answers the
next matching request with that status (``Retry-After`` when given), before it is handled, or
after it was (``when="after"``: the write landed but the client saw an error, as on a timeout).
``server.on_request(fn)`` calls ``fn(method, path, code)`` after each answered request, which is
how fault tests stop a controller exactly after a given write. ``server.outage(seconds)``
behaves as a restarting API server does: for that long every request's connection is dropped
without an answer and open watches end.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple

from tests.fakekube import status as statuses
from tests.fakekube.api import Api
from tests.fakekube.errors import ApiStatusError
from tests.fakekube.faults import Fault, Faults
from tests.fakekube.objects import Obj, Resource, WatchEvent
from tests.fakekube.rbac import ADMIN, Attributes, Authorizer, User
from tests.fakekube.selectors import LabelSelector, field_selector

Observer = Callable[[str, str, int], None]


def _route(parts: List[str]) -> Tuple[str, str, List[str]]:
    """(group, version, rest) of a resource path, or raise 404."""
    if parts[:1] == ["api"] and len(parts) >= 2:
        return "", parts[1], parts[2:]
    if parts[:1] == ["apis"] and len(parts) >= 3:
        return parts[1], parts[2], parts[3:]
    raise statuses.error(404, "the server could not find the requested resource")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - stdlib names
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    # --- plumbing ---------------------------------------------------------------------------

    def _send(self, code: int, body: Any, headers: Optional[Dict[str, str]] = None,
              content_type: str = "application/json") -> None:
        """Keep the answer until the request is fully handled (an "after" fault may replace it)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.pending = (code, data, headers or {}, content_type)

    def _flush(self) -> None:
        code, data, headers, content_type = self.pending
        self.pending = None
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)
        self.code = code

    def _send_error(self, exc: ApiStatusError) -> None:
        self._send(exc.code, statuses.body(exc), exc.headers)

    def _warnings(self, warnings: List[str]) -> Dict[str, str]:
        # http.server cannot repeat a header through a dict; join like a proxy would.
        if not warnings:
            return {}
        quoted = (w.replace('"', "'") for w in warnings)
        return {"Warning": ", ".join(f'299 - "{w}"' for w in quoted)}

    def _dispatch(self, method: str) -> None:
        owner: ApiServer = self.server.owner
        self.code = 0
        self.pending: Optional[Tuple[int, bytes, Dict[str, str], str]] = None
        if owner.down:
            self.close_connection = True  # restarting: the connection just drops
            return
        url = urllib.parse.urlsplit(self.path)
        params = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            user = owner.authenticate(self.headers.get("Authorization"))
            if user is None:
                raise statuses.error(401, "Unauthorized")
            fault = owner.faults.take(method, url.path, "before")
            if fault is not None:
                raise self._fault_error(fault)
            self._handle(method, url.path, params, raw, user)
            if self.pending is not None:
                fault = owner.faults.take(method, url.path, "after")
                if fault is not None:
                    raise self._fault_error(fault)
                self._flush()
        except ApiStatusError as exc:
            if not self.code:
                self._send_error(exc)
                self._flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        finally:
            for observer in list(owner.observers):
                observer(method, url.path, self.code)

    def _fault_error(self, fault: Fault) -> ApiStatusError:
        headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
        return statuses.error(fault.status, fault.message or f"injected fault {fault.status}",
                              headers=headers)

    def _handle(self, method: str, path: str, params: Dict[str, str], raw: bytes,
                user: User) -> None:
        owner: ApiServer = self.server.owner
        api = owner.api
        parts = [p for p in path.split("/") if p]
        if method == "GET" and (not parts or parts[0] in ("version", "healthz", "readyz", "livez")
                                or len(parts) <= 3 and parts[0] in ("api", "apis")
                                and self._discovery(parts)):
            return
        group, version, rest = _route(parts)
        namespace: Optional[str] = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        plural, name, sub = rest[0], (rest[1] if len(rest) > 1 else ""), (rest[2] if len(rest) > 2 else "")
        res = api.resource(group, version, plural)
        if namespace is not None and not res.namespaced:
            raise statuses.error(404, f"{plural} is not a namespaced resource")
        owner.authorize(user, method, params, res, namespace, name, sub)
        body = None
        if raw and method != "PATCH":
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise statuses.error(400, f"the request body is not JSON: {exc}") from None
        if not name:
            if method == "GET" and params.get("watch") in ("true", "1"):
                self._watch(res, namespace, params)
            elif method == "GET":
                self._send(200, api.list(res, namespace, params))
            elif method == "POST":
                obj, warnings = api.create(res, namespace, body, params, user=user)
                self._send(201, obj, self._warnings(warnings))
            elif method == "DELETE":
                self._send(200, api.delete_collection(res, namespace, body, params, user=user))
            else:
                raise statuses.error(405, f"{method} is not allowed on a collection")
            return
        if sub and sub not in ("status",) + res.subresources:
            raise statuses.error(404, f"the server could not find the requested resource ({sub})")
        if sub == "log" and method == "GET":
            self._send(200, api.log(namespace or "", name, params), content_type="text/plain")
        elif sub == "binding" and method == "POST":
            self._send(201, api.bind(namespace or "", name, body))
        elif method == "GET":
            self._send(200, api.get(res, namespace, name))
        elif method == "PUT":
            obj, warnings = api.update(res, namespace, name, body, params, sub, user=user)
            self._send(200, obj, self._warnings(warnings))
        elif method == "PATCH":
            obj, warnings = api.patch(res, namespace, name, raw,
                                      self.headers.get("Content-Type", ""), params, sub,
                                      user=user)
            self._send(200, obj, self._warnings(warnings))
        elif method == "DELETE" and not sub:
            self._send(200, api.delete(res, namespace, name, body, params, user=user))
        else:
            raise statuses.error(405, f"{method} is not allowed here")

    # --- discovery --------------------------------------------------------------------------

    def _discovery(self, parts: List[str]) -> bool:
        api = self.server.owner.api
        resources = api.resources()
        if not parts or parts[0] in ("healthz", "readyz", "livez"):
            self._send(200, b"ok", content_type="text/plain")
        elif parts[0] == "version":
            self._send(200, {"major": "1", "minor": api.schema_version.split(".")[1],
                             "gitVersion": f"v{api.schema_version}.0-xmem-standin",
                             "platform": "linux/amd64"})
        elif parts == ["api"]:
            self._send(200, {"kind": "APIVersions", "versions": ["v1"],
                             "serverAddressByClientCIDRs": []})
        elif parts == ["apis"]:
            groups: Dict[str, List[str]] = {}
            for res in resources:
                if res.group:
                    versions = groups.setdefault(res.group, [])
                    if res.version not in versions:
                        versions.append(res.version)
            self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                 "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}}
                for g, vs in sorted(groups.items())]})
        elif (parts[0] == "api" and len(parts) == 2) or (parts[0] == "apis" and len(parts) == 3):
            group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
            served = [r for r in resources if r.group == group and r.version == version]
            if not served:
                return False
            entries = []
            for res in served:
                verbs = ["create", "delete", "deletecollection", "get", "list", "patch",
                         "update", "watch"]
                entries.append({"name": res.plural, "singularName": res.singular,
                                "namespaced": res.namespaced, "kind": res.kind, "verbs": verbs,
                                "shortNames": list(res.short_names)})
                for sub in (("status",) if res.status else ()) + res.subresources:
                    entries.append({"name": f"{res.plural}/{sub}", "singularName": "",
                                    "namespaced": res.namespaced, "kind": res.kind,
                                    "verbs": ["get", "patch", "update"]})
            self._send(200, {"kind": "APIResourceList", "apiVersion": "v1",
                             "groupVersion": f"{group}/{version}" if group else version,
                             "resources": entries})
        else:
            return False
        return True

    # --- watch ------------------------------------------------------------------------------

    def _chunk(self, payload: Dict[str, Any]) -> None:
        data = json.dumps(payload).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, res: Resource, namespace: Optional[str], params: Dict[str, str]) -> None:
        owner: ApiServer = self.server.owner
        storage = owner.api.storage
        labels = LabelSelector.parse(params.get("labelSelector"))
        fields = field_selector(params.get("fieldSelector"), res.kind)
        timeout = min(float(params.get("timeoutSeconds") or owner.watch_timeout),
                      owner.watch_timeout)
        bookmarks = params.get("allowWatchBookmarks") in ("true", "1")
        rv_param = params.get("resourceVersion") or ""

        def selected(obj: Optional[Obj]) -> bool:
            if obj is None:
                return False
            m = obj.get("metadata") or {}
            if namespace is not None and m.get("namespace") != namespace:
                return False
            return labels.matches(m.get("labels")) and fields(obj)

        initial: List[Dict[str, Any]] = []
        with storage.lock:
            if rv_param in ("", "0"):
                cursor = storage.resource_version
                items, _ = storage.list(res, namespace)
                initial = [{"type": "ADDED", "object": o} for o in items if selected(o)]
            else:
                try:
                    cursor = int(rv_param)
                except ValueError:
                    raise statuses.error(400, f"invalid resourceVersion {rv_param!r}") from None
                if cursor < storage.oldest_version:
                    raise statuses.error(410, f"too old resource version: {cursor} "
                                         f"({storage.oldest_version})", "Expired")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.code = 200
        for event in initial:
            self._chunk(event)
        deadline = time.monotonic() + timeout
        last_bookmark = time.monotonic()
        try:
            while time.monotonic() < deadline and not owner.stopping.is_set() and not owner.down:
                with storage.lock:
                    try:
                        pending: List[WatchEvent] = list(storage.events_after(cursor))[::-1]
                    except ApiStatusError as exc:
                        self._chunk({"type": "ERROR", "object": statuses.body(exc)})
                        break
                    if not pending:
                        storage.changed.wait(min(0.25, max(0.0, deadline - time.monotonic())))
                        pending = []
                for event in pending:
                    cursor = event.rv
                    if event.key != res.key:
                        continue
                    out = self._translate(event, selected)
                    if out is not None:
                        self._chunk({"type": out, "object": event.obj})
                if bookmarks and time.monotonic() - last_bookmark > owner.bookmark_seconds:
                    last_bookmark = time.monotonic()
                    self._chunk({"type": "BOOKMARK", "object": {
                        "kind": res.kind, "apiVersion": res.api_version,
                        "metadata": {"resourceVersion": str(max(cursor, storage.resource_version))}}})
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            self.close_connection = True

    @staticmethod
    def _translate(event: WatchEvent, selected: Callable[[Optional[Obj]], bool]) -> Optional[str]:
        now_in, was_in = selected(event.obj), selected(event.old)
        if event.type == "ADDED":
            return "ADDED" if now_in else None
        if event.type == "DELETED":
            return "DELETED" if now_in or was_in else None
        if now_in and was_in:
            return "MODIFIED"
        if now_in:
            return "ADDED"
        return "DELETED" if was_in else None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: ApiServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, ssl.SSLError, socket.timeout, TimeoutError)):
            return
        super().handle_error(request, client_address)


class ApiServer:
    """The stand-in API server: start it, point a kubeconfig at it, drive it with any client."""

    def __init__(self, tls: bool = True, token: Optional[str] = "xmem-standin-token",
                 schema_version: str = "1.30", watch_timeout: float = 1800.0,
                 bookmark_seconds: float = 5.0) -> None:
        self.api = Api(schema_version)
        self.tls = tls
        self.token = token
        self.watch_timeout = watch_timeout
        self.bookmark_seconds = bookmark_seconds
        self.faults = Faults()
        self.observers: List[Observer] = []
        self.stopping = threading.Event()
        self.ca_pem = b""
        self.users: Dict[str, User] = {token: ADMIN} if token else {}
        self._down_until = 0.0
        self.authorizer = Authorizer(self.api.storage)
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def storage(self) -> Any:
        return self.api.storage

    def on_request(self, observer: Observer) -> None:
        self.observers.append(observer)

    # --- outages ----------------------------------------------------------------------------

    def outage(self, seconds: float) -> None:
        """Drop every connection for ``seconds``, as while the API server restarts."""
        self._down_until = time.monotonic() + seconds

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    # --- users ------------------------------------------------------------------------------

    def add_user(self, user: User) -> str:
        """A bearer token for ``user`` (RBAC decides what it may do, unless a superuser)."""
        import secrets

        token = secrets.token_urlsafe(24)
        self.users[token] = user
        return token

    def authenticate(self, header: Optional[str]) -> Optional[User]:
        if not self.token:
            return ADMIN  # authentication off
        if not header or not header.startswith("Bearer "):
            return None
        return self.users.get(header[len("Bearer "):])

    def authorize(self, user: User, method: str, params: Dict[str, str], res: Any,
                  namespace: Optional[str], name: str, sub: str) -> None:
        """Raise 403 unless RBAC allows the request (the message a real server gives)."""
        if method == "GET":
            verb = "get" if name else "watch" if params.get("watch") in ("true", "1") else "list"
        else:
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                    "DELETE": "delete" if name else "deletecollection"}[method]
        if sub == "binding":
            verb = "create"
        attrs = Attributes(verb, res.group, res.plural, sub, namespace or "", name)
        if not self.authorizer.allowed(user, attrs):
            what = f'{res.plural} "{name}"' if name else res.plural
            raise statuses.error(403, f'{what} is forbidden: User "{user.username}" '
                                 f"{attrs.describe()}", "Forbidden")

    def start(self) -> ApiServer:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.owner = self
        if self.tls:
            import trustme

            ca = trustme.CA()
            cert = ca.issue_cert("127.0.0.1", "localhost")
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            cert.configure_cert(context)
            server.socket = context.wrap_socket(server.socket, server_side=True,
                                                do_handshake_on_connect=False)
            self.ca_pem = ca.cert_pem.bytes()
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="standin-apiserver", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def stop(self) -> None:
        self.stopping.set()
        with self.api.storage.lock:
            self.api.storage.changed.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.api.storage.stop()

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- clients ----------------------------------------------------------------------------

    def kubeconfig(self, path: str, namespace: str = "default",
                   token: Optional[str] = None) -> str:
        """Write a kubeconfig for this server (CA data and token inline; the server's own
        superuser token unless ``token``); returns the path."""
        import base64

        import yaml

        cluster: Dict[str, Any] = {"server": self.url}
        if self.tls:
            cluster["certificate-authority-data"] = base64.b64encode(self.ca_pem).decode()
        token = token or self.token
        user: Dict[str, Any] = {"token": token} if token else {}
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": cluster}],
            "users": [{"name": "standin", "user": user}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin",
                                                         "namespace": namespace}}],
        }
        with open(path, "w", encoding="utf-8") as handle:
            yaml.safe_dump(config, handle)
        return path

    def api_client(self, token: Optional[str] = None) -> Any:
        """An official ``kubernetes.client.ApiClient`` for this server (CA file and token set:
        the superuser's unless ``token``)."""
        import tempfile

        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.url
        if self.tls:
            handle = tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False)
            handle.write(self.ca_pem)
            handle.close()
            configuration.ssl_ca_cert = handle.name
        if token or self.token:
            configuration.api_key = {"authorization": f"Bearer {token or self.token}"}
        return client.ApiClient(configuration)

    # --- seeding (tests): the same code path as a request, without HTTP -----------------------

    def create(self, obj: Obj, namespace: Optional[str] = None) -> Obj:
        res = self.api.kind(obj["apiVersion"], obj["kind"])
        ns = (namespace or (obj.get("metadata") or {}).get("namespace") or "default") \
            if res.namespaced else None
        return self.api.create(res, ns, obj)[0]

    def apply_file(self, path: str) -> List[Obj]:
        """Create every object of a YAML file (CRDs, policies, webhook configurations)."""
        import yaml

        with open(path, encoding="utf-8") as handle:
            return [self.create(doc) for doc in yaml.safe_load_all(handle) if doc]

    def get(self, api_version: str, kind: str, name: str, namespace: Optional[str] = None) -> Obj:
        res = self.api.kind(api_version, kind)
        return self.api.get(res, namespace if res.namespaced else None, name)

    def list(self, api_version: str, kind: str, namespace: Optional[str] = None,
             label_selector: str = "") -> List[Obj]:
        res = self.api.kind(api_version, kind)
        params = {"labelSelector": label_selector} if label_selector else {}
        return self.api.list(res, namespace, params)["items"]

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0,
                 what: str = "condition") -> Any:
        """Poll ``predicate`` until it returns something truthy; AssertionError on timeout."""
        return wait_for(predicate, timeout, what)


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``predicate`` every 50 ms until it returns something truthy, and return that;
    AssertionError naming ``what`` after ``timeout`` seconds (tests wait on the cluster so)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
