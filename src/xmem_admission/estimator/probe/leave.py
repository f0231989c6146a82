"""Leaving a traced process once its result is written.

The probe's result is on disk when the script's last traced step is done; what the process
would do after it only costs time. Python's own exit runs the script's ``atexit`` handlers (a
tracker's run finished, a log uploaded: side effects the estimate turned off or must not
have), joins its non-daemon threads and frees every object the libraries and the trace hold,
one by one: about 2.5 s for a Transformers + TRL job on this project's machine (measured with
``trl_sft.py`` on the tiny checkpoint, ``tests/finetune``), more with a trace of millions of
events. ``leave`` does only what the probe needs: it flushes what the script printed, removes
the probe's own temporary folders, stops the script's ``multiprocessing`` children (data
loader workers would otherwise wait for a parent that is gone) and ends the process with
``os._exit``.

Standard library only (the pod's site hook imports it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from typing import List, NoReturn

# Folders the probe made for itself, removed by ``leave`` (and by ``atexit`` when the process
# ends some other way).
_OWN: List[str] = []


def remove_at_exit(path: str) -> None:
    """Remove ``path`` (a folder of the probe's own) when the process ends, however it ends."""
    _OWN.append(path)
    atexit.register(shutil.rmtree, path, True)


def _stop_children() -> None:
    mp = sys.modules.get("multiprocessing")
    if mp is None:
        return
    try:
        # only this process's own: a process forked without multiprocessing (a batched trace
        # of the pod) inherits its parent's list of children
        children = [child for child in mp.active_children()
                    if getattr(child, "_parent_pid", None) == os.getpid()]
        for child in children:
            child.terminate()
        for child in children:
            child.join(timeout=2)
    except Exception:  # noqa: BLE001 - a child that cannot be stopped must not keep us here
        pass


def leave(code: int) -> NoReturn:
    """End the process now with ``code``, after the probe's own clean-up (see the module)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep us alive
            pass
    for path in _OWN:
        shutil.rmtree(path, True)
    _stop_children()
    os._exit(code)
