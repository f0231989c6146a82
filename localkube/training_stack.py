"""The training stack's build: JobSet and Kubeflow Trainer v2 at the releases in
scripts/trainer-versions.env, built together by scripts/build-trainer.sh (``make tools``) into one
cache entry.

Its own module because both the cluster (``localkube.cluster``: the CRDs every shared cluster
serves) and the controllers that run on it (``localkube.jobset``, ``localkube.trainer``) read
the entry.
"""

from __future__ import annotations

from pathlib import Path

from localkube import tools

VERSIONS_FILE = tools.ROOT / "scripts" / "trainer-versions.env"
BUILD = "`make tools` (scripts/build-trainer.sh)"


def home() -> Path:
    """The build's cache entry (JobSet and Trainer share it); raises ``tools.ToolsMissing``
    naming the command that builds it."""
    v = tools.read_env(VERSIONS_FILE)
    return tools.cache_entry(
        "XMEM_TRAINER_CACHE", "trainer",
        f"{v['JOBSET_VERSION']}_{v['TRAINER_VERSION']}_r{v['TRAINER_BUILD_RECIPE']}",
        "the training stack (JobSet and Kubeflow Trainer)", BUILD)
