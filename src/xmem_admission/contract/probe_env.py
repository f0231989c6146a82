"""The environment through which an estimation pod configures the probe bundle.

The controller writes these variables into the estimation container (``cluster.controller.
podspec``); the bundle's ``sitecustomize`` reads them in the user's interpreter
(``estimator.probe.sitehook``). One list, so that neither side can rename a variable alone.
"""

from __future__ import annotations

ON = "XMEM_PROBE"  # "1": every Python process of the container starts under the probe
ON_VALUE = "1"
GPUS = "XMEM_PROBE_GPUS"  # comma-separated catalogue names of the target GPU models
STEPS = "XMEM_PROBE_STEPS"  # optimizer steps to trace
MODE = "XMEM_PROBE_MODE"  # auto, fake or profile
RESULT_PATH = "XMEM_RESULT_PATH"  # where the result goes: the container's terminationMessagePath
FALLBACK = "XMEM_PROBE_FALLBACK"  # set by the probe itself when it re-executes in profile mode
DEFAULT_RESULT_PATH = "/dev/termination-log"  # the kubelet's default terminationMessagePath
# A writable folder of the pod's own (an emptyDir): HOME and TMPDIR for the probe's processes
# where the image's are not writable for the pod's user (UID 65532 has no home in most images;
# a read-only root file system leaves no writable /tmp).
SCRATCH = "XMEM_PROBE_SCRATCH"
# Beside the bundle's sitecustomize: what the estimation pod's second init container, run from
# the workload's image, found in the image's own environment ({"PYTHONPATH": str or null}).
IMAGE_ENV_FILE = "image-env.json"
# Several estimates traced in one pod (JSON: {"estimates": [name, ...], "argv": [[word, ...],
# ...]}, the container's own command line first): one interpreter start and torch import, a fork
# per trace, one after the other; the result is a batch (``termination.encode_batch``).
BATCH = "XMEM_PROBE_BATCH"
TRACE_SECONDS = "XMEM_PROBE_TRACE_SECONDS"  # one trace of a batch: killed past this many seconds

ALL = (ON, GPUS, STEPS, MODE, RESULT_PATH, FALLBACK, SCRATCH, BATCH, TRACE_SECONDS)
