"""Which ``nn.Module`` runs now, and which module made each autograd node: the trace's module
paths.

Runs inside users' images: Python >= 3.9, torch >= 2.2, no other dependency.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from xmem_admission.estimator.trace import LOSS

# Attributes through which a wrapper holds the module it wraps: the level is left out of module
# paths (DDP's and DataParallel's ``module``, FSDP1's ``_fsdp_wrapped_module``,
# checkpoint_wrapper's ``_checkpoint_wrapped_module``, torch.compile's ``_orig_mod``).
# The classes that hold it (empty: any).
_WRAPPER_ATTRS: Dict[str, Tuple[str, ...]] = {
    "_fsdp_wrapped_module": (), "_checkpoint_wrapped_module": (), "_orig_mod": (),
    "module": ("DistributedDataParallel", "DataParallel")}
# An autograd node made outside the thread's sequence (AccumulateGrad's, UINT64_MAX in
# torch/csrc/autograd/function.h) belongs to no forward module.
NO_SEQUENCE = 1 << 63


class ModuleTracker:
    """The ``nn.Module`` running now, and which module made each autograd node.

    Module paths come from the probe's global forward hooks (``enter``/``exit``). Autograd
    numbers its nodes in creation order on each thread (``Node::sequence_nr``,
    torch/csrc/autograd/function.h, from ``at::sequence_number::get_and_increment``); at each
    module boundary the next number is noted, so a backward node's number names the forward
    module that was running when the node was made (``module_of_node``). Python has no
    binding that reads the counter, so it is read by making one node (a view of a leaf) with
    the dispatcher's and torch-function modes off: two module boundaries per module call, a
    few microseconds each.
    """

    def __init__(self) -> None:
        self.stack: List[Tuple[Any, str]] = []
        self.path = ""
        self.outside = ""  # the path outside any module: LOSS after a forward, else ""
        self._paths: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._starts: List[int] = []
        self._at: List[str] = []
        self._leaf: Optional[torch.Tensor] = None

    def _next_sequence_nr(self) -> int:
        if self._leaf is None:
            with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
                self._leaf = torch.zeros(1, requires_grad=True)
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), \
                torch.enable_grad():
            node = self._leaf.view(1).grad_fn
        return int(node._sequence_nr()) + 1 if node is not None else 0

    def _boundary(self) -> None:
        try:
            start = self._next_sequence_nr()
        except Exception:  # noqa: BLE001 - a torch without these guards: forward paths only
            return
        if self._starts and self._starts[-1] == start:
            self._at[-1] = self.path
        else:
            self._starts.append(start)
            self._at.append(self.path)

    def path_of(self, module: Any) -> str:
        path = self._paths.get(module)
        if path is None:
            path = self._name(module)
            try:
                self._paths[module] = path
            except TypeError:  # not weakly referenceable: named again next time
                pass
        return path

    def _name(self, module: Any) -> str:
        if not self.stack:
            return type(module).__name__
        parent, parent_path = self.stack[-1]
        return child_path(parent, parent_path, module, _child_name(parent, module),
                          len(self.stack) == 1)

    def enter(self, module: Any) -> None:
        if not self.stack:
            self.outside = ""
        path = self.path_of(module)
        self.stack.append((module, path))
        self.path = path
        self._boundary()

    def exit(self, module: Any) -> None:
        stack = self.stack
        for depth in range(len(stack) - 1, -1, -1):
            if stack[depth][0] is module:
                del stack[depth:]
                break
        else:
            return
        self.path = stack[-1][1] if stack else self.outside
        self._boundary()

    def leave_forward(self) -> None:
        """The model's forward is over: what runs outside modules now is the loss."""
        if not self.stack:
            self.outside = self.path = LOSS
            self._boundary()

    def reset(self) -> None:
        """A backward starts: any forward left open (one that raised) is over."""
        self.stack.clear()
        self.outside = self.path = ""
        self._boundary()

    def module_of_node(self, sequence_nr: int) -> str:
        if sequence_nr >= NO_SEQUENCE:
            return ""
        at = bisect.bisect_right(self._starts, sequence_nr) - 1
        return self._at[at] if at >= 0 else ""


def child_path(parent: Any, parent_path: str, child: Any, attr: Optional[str],
               parent_is_root: bool) -> str:
    """The module path of ``child``, held by ``parent`` under ``attr`` (None: not held)."""
    if attr is None:
        return f"{parent_path}.{type(child).__name__}"
    owners = _WRAPPER_ATTRS.get(attr.split(".")[-1])
    if owners is not None and (not owners or type(parent).__name__ in owners):
        # a wrapper level: the wrapped module takes the wrapper's path (under a root wrapper,
        # its own class name, as a root has)
        return type(child).__name__ if parent_is_root else parent_path
    return f"{parent_path}.{attr}"


def _child_name(parent: Any, child: Any) -> Optional[str]:
    """The attribute path under which ``parent`` holds ``child`` (None: it does not)."""
    for name, sub in getattr(parent, "_modules", {}).items():
        if sub is child:
            return str(name)
    named = getattr(parent, "named_modules", None)
    if named is not None:
        try:
            for name, sub in named():
                if sub is child and name:
                    return str(name)
        except Exception:  # noqa: BLE001 - a module whose children cannot be listed
            return None
    return None

