"""A real Prometheus for tests (the binary ``make tools`` installs), scraping an exporter the
test serves: the n-th scrape gets ``exposition(n)``, so a test decides which scrape holds a
peak (a spike an instant query misses) and knows when each was served."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, List, Tuple

import yaml

from localkube.controlplane import free_port
from localkube.controlplane import wait_while_running as wait_for
from tests.helm.chart import tool


def reply(handler: BaseHTTPRequestHandler, body: bytes, content_type: str) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class Exporter(ThreadingHTTPServer):
    """Serves ``exposition(n)`` to the n-th scrape and remembers when it served each."""

    def __init__(self, exposition: Callable[[int], str]) -> None:
        super().__init__(("127.0.0.1", 0), ScrapeHandler)
        self.exposition = exposition
        self.served: List[float] = []
        self.lock = threading.Lock()

    def start(self) -> Exporter:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class ScrapeHandler(BaseHTTPRequestHandler):
    server: Exporter

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        with self.server.lock:
            n = len(self.server.served)
            self.server.served.append(time.time())
        reply(self, self.server.exposition(n).encode(), "text/plain; version=0.0.4")

    def log_message(self, *args: object) -> None:
        pass


def start_prometheus(work: Path, exporter: Exporter) -> Tuple[subprocess.Popen, str]:
    port = free_port()
    config = {"global": {"scrape_interval": "1s"},
              "scrape_configs": [{"job_name": "gpu-exporters", "honor_labels": True,
                                  "static_configs": [{"targets": [
                                      f"127.0.0.1:{exporter.server_port}"]}]}]}
    work.mkdir(parents=True, exist_ok=True)
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [tool("prometheus"), f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200,
             "Prometheus ready", process)
    return process, url


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)  # in case a test left it stopped
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
