"""The training command a probe runs: the program one rank runs, and the distributed launch a
launcher's command line describes (``contract.launch``). Standard library only: read by the
probe in the estimation pod (``probe.runner``, ``probe.sitehook``) and by ``estimate`` before
it starts one."""

from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence


def split_command(command: Sequence[str]) -> List[str]:
    """``python [-u] train.py a b`` / ``python -m pkg a`` / ``train.py a`` -> argv without python;
    a launcher's command line (``torchrun ... train.py a``) -> the program one rank runs.

    The interpreter word (``python``, ``python3.13``, ``/venv/bin/python``) is dropped whatever
    its path: the process running this is the interpreter that traces (``estimate.
    choose_interpreter`` picked it); a script whose name starts with ``python``
    (``python_train.py``) is the program, not an interpreter."""
    launch = launch_of(command)
    if launch is not None:
        return list(launch.program)
    argv = list(command)
    name = os.path.basename(argv[0]) if argv else ""
    if name.startswith("python") and not name.endswith(".py"):
        argv = argv[1:]
        while argv and argv[0] in ("-u", "-B", "-O", "-W") or (argv and argv[0].startswith("-W")):
            argv = argv[2:] if argv[0] == "-W" else argv[1:]
    return argv


def launch_of(command: Sequence[str]) -> Optional[Any]:
    """The distributed launch ``command`` describes (``contract.launch``), or None; raises
    ``LaunchError`` for a launcher the probe cannot trace."""
    from xmem_admission.contract import launch
    from xmem_admission.contract.errors import LaunchError

    found = launch.parse(command, gpus_per_node=_gpus_per_node())
    if found is None:
        return None
    if found.launcher in launch.UNSUPPORTED:
        raise LaunchError(launch.UNSUPPORTED[found.launcher])
    if found.use_deepspeed:
        raise LaunchError(launch.UNSUPPORTED[launch.Launcher.DEEPSPEED])
    return found


def _gpus_per_node() -> Optional[int]:
    """How many GPUs a node of the job has, for ``--nproc-per-node gpu``: XMEM_GPUS_PER_NODE
    (set by the estimation pod from the workload's request), else unknown."""
    value = os.environ.get("XMEM_GPUS_PER_NODE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None
