"""Where the script is now, and an op's name: the words the probe's messages use.

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

# torch's own Python files (a path under the folder of torch's package, not any path with a
# "torch" folder in it: a user's environment may be called that).
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def where_in_script() -> str:
    """The innermost frame outside torch and xmem: where the script is now."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = frame.filename
        if name.startswith(_TORCH_DIR) or "xmem_admission" in name or name.startswith("<"):
            continue
        return f"{name}:{frame.lineno} ({(frame.line or '').strip()[:80]})"
    return "unknown location"


def op_name(func: Any) -> str:
    """``aten.nll_loss_forward`` for an OpOverload (its packet's name)."""
    return f"aten.{getattr(func, '__name__', str(func)).split('.')[0]}"
