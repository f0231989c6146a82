"""A local Hugging Face Hub for tests: serves model repositories from folders over HTTP.

Point ``huggingface_hub`` at it with ``HF_ENDPOINT=<server.endpoint>``. It answers what
``huggingface_hub`` 1.x asks when transformers loads a model by its Hub id:

- ``HEAD``/``GET /{repo_id}/resolve/{revision}/{path}``: the file, with the headers
  ``file_download.get_hf_file_metadata`` reads (``X-Repo-Commit``, ``ETag``, and for the large
  files the Hub stores in LFS, ``X-Linked-Etag`` and ``X-Linked-Size``), byte ranges
  (``Range: bytes=a-b`` answered ``206`` with ``Content-Range``), and ``404`` with
  ``X-Error-Code: EntryNotFound`` for a missing file (``utils/_http.py``,
  ``hf_raise_for_status``, turns it into ``EntryNotFoundError``);
- ``GET /api/models/{repo_id}[/revision/{revision}]``: the repository's info with its files;
- ``GET /api/models/{repo_id}/tree/{revision}[/{path}]``: the files under a folder.

Every body byte it sends is counted per file (``served``), and every request is logged
(``requests``), so a test can say exactly what was downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from urllib.parse import unquote, urlsplit

# Files the Hub keeps in LFS (its .gitattributes default): these get the X-Linked-* headers.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class HubServer:
    """``with HubServer({"org/name": folder}) as hub:`` serves each folder as a model repo."""

    def __init__(self, repos: Dict[str, Path]) -> None:
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        # one commit per repository, as the Hub names a revision's snapshot
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in self.repos}
        self.served: Dict[str, int] = {}
        self.requests: List[Tuple[str, str, Optional[str]]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def bytes_served(self, repo: str, path: str) -> int:
        with self._lock:
            return self.served.get(f"{repo}/{path}", 0)

    def _count(self, key: str, nbytes: int) -> None:
        with self._lock:
            self.served[key] = self.served.get(key, 0) + nbytes

    def _log(self, method: str, path: str, byte_range: Optional[str]) -> None:
        with self._lock:
            self.requests.append((method, path, byte_range))

    def find(self, path: str) -> Tuple[Optional[str], str]:
        """The repository a URL path starts with, and the rest."""
        for repo in sorted(self.repos, key=len, reverse=True):
            if path == repo or path.startswith(repo + "/"):
                return repo, path[len(repo) + 1:]
        return None, path

    def files(self, repo: str) -> List[str]:
        root = self.repos[repo]
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _etag(path: Path) -> str:
    """The Hub's ETag: the LFS object's sha256 for an LFS file, a git blob's sha1 otherwise (any
    stable digest of the content serves the client's cache)."""
    if path.name.endswith(LFS_SUFFIXES):
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            # the header only: a sparse checkpoint of 16 GB would take minutes to hash, and the
            # digest need only be stable
            digest.update(fh.read(1 << 20))
        digest.update(str(path.stat().st_size).encode())
        return digest.hexdigest()
    return hashlib.sha1(b"blob %d\0" % path.stat().st_size + path.read_bytes()).hexdigest()


def _handler(hub: HubServer) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's
            return None

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path).lstrip("/")
            hub._log(self.command, path, self.headers.get("Range"))
            if path.startswith("api/models/"):
                self._api(path[len("api/models/"):])
                return
            repo, rest = hub.find(path)
            match = re.match(r"^resolve/([^/]+)/(.+)$", rest) if repo else None
            if repo is None or match is None:
                self._error(404, "RepoNotFound" if repo is None else "EntryNotFound")
                return
            revision, name = match.groups()
            if revision not in ("main", hub.commits[repo]):
                self._error(404, "RevisionNotFound")
                return
            file = hub.repos[repo] / name
            if not file.is_file():
                self._error(404, "EntryNotFound")
                return
            self._file(repo, name, file, body)

        def _file(self, repo: str, name: str, file: Path, body: bool) -> None:
            size = file.stat().st_size
            first, last = 0, size - 1
            wanted = self.headers.get("Range")
            partial = False
            if wanted:
                match = _RANGE.match(wanted.strip())
                if match is None or (not match.group(1) and not match.group(2)):
                    self._error(416, "InvalidRange")
                    return
                if match.group(1):
                    first = int(match.group(1))
                    last = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
                else:  # the last N bytes
                    first = max(size - int(match.group(2)), 0)
                if first > last:
                    self._error(416, "InvalidRange")
                    return
                partial = True
            etag = _etag(file)
            self.send_response(206 if partial else 200)
            self.send_header("X-Repo-Commit", hub.commits[repo])
            self.send_header("ETag", f'"{etag}"')
            if name.endswith(LFS_SUFFIXES):
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(size))
            self.send_header("Accept-Ranges", "bytes")
            if partial:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Content-Length", str(last - first + 1))
            self.end_headers()
            if not body:
                return
            with open(file, "rb") as fh:
                fh.seek(first)
                left = last - first + 1
                while left > 0:
                    chunk = fh.read(min(left, 1 << 16))
                    if not chunk:
                        break
                    try:
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        return  # the client took what it needed and closed
                    hub._count(f"{repo}/{name}", len(chunk))  # counted once sent
                    left -= len(chunk)

        def _api(self, rest: str) -> None:
            repo, tail = hub.find(rest)
            if repo is None:
                self._error(404, "RepoNotFound")
                return
            commit = hub.commits[repo]
            if tail == "" or re.match(r"^revision/[^/]+$", tail):
                self._json({"id": repo, "modelId": repo, "sha": commit, "private": False,
                            "siblings": [{"rfilename": f} for f in hub.files(repo)]})
                return
            match = re.match(r"^tree/[^/]+/?(.*)$", tail)
            if match is None:
                self._error(404, "EntryNotFound")
                return
            folder = match.group(1).strip("/")
            root = hub.repos[repo] / folder
            if not root.is_dir():
                self._error(404, "EntryNotFound")
                return
            entries = []
            for child in sorted(root.iterdir()):
                relative = os.path.join(folder, child.name) if folder else child.name
                if child.is_dir():
                    entries.append({"type": "directory", "path": relative, "oid": commit})
                else:
                    entries.append({"type": "file", "path": relative, "oid": _etag(child),
                                    "size": child.stat().st_size})
            self._json(entries)

        def _json(self, value: object) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, code: str) -> None:
            data = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler
