"""A whole stand-in cluster for a test: API server, node, Job controller, kubeconfig.

``Cluster(tmp_dir, crds=[...]).start()`` starts the stand-in API server over HTTPS, creates the
given CustomResourceDefinitions (the project's own from ``helm/``, Kubeflow's PyTorchJob from
the tests' data), starts a node (``Kubelet``) that runs pods with this interpreter's
environment first on ``PATH`` (so ``python`` in a container command is this Python, with torch),
optionally the Job controller, and writes a kubeconfig for any client. Images listed in
``unpullable`` fail to pull.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Iterable, Optional, Sequence

from tests.fakekube.apiserver import ApiServer
from tests.fakekube.jobs import JobController
from tests.fakekube.kubelet import Kubelet
from tests.realkube.containers import Image

PROBE_IMAGE = "registry.example/xmem-admission:test"


class Cluster:
    """See the module docstring."""

    def __init__(self, root: str, crds: Sequence[str] = (), unpullable: Iterable[str] = (),
                 images: Optional[Dict[str, Image]] = None, jobs: bool = False,
                 kubelet: bool = True, node_selector: str = "") -> None:
        self.root = root
        self.crds = list(crds)
        self.server = ApiServer()
        self.kubelet: Optional[Kubelet] = None
        self.jobs: Optional[JobController] = None
        self._want_jobs = jobs
        self._want_kubelet = kubelet
        self._unpullable = list(unpullable)
        self._images = dict(images or {})
        self._selector = node_selector
        self.kubeconfig = os.path.join(root, "kubeconfig")

    def start(self) -> Cluster:
        self.server.start()
        for path in self.crds:
            self.server.apply_file(path)
        self.server.kubeconfig(self.kubeconfig)
        if self._want_kubelet:
            self.kubelet = Kubelet(
                self.server, images=self._images, unpullable=self._unpullable,
                path_prefix=[os.path.dirname(sys.executable)], selector=self._selector,
                root=os.path.join(self.root, "node")).start()
        if self._want_jobs:
            self.jobs = JobController(self.server).start()
        return self

    def stop(self) -> None:
        if self.jobs is not None:
            self.jobs.stop()
        if self.kubelet is not None:
            self.kubelet.stop()
        self.server.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
