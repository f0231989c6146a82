"""The conformance corpus's yardstick: what a GPU holds for a model's training state, computed
from the model and optimizer themselves (never from the probe's trace), and the trace read the
same way for comparison.

Each corpus script keeps its model and optimizer construction in ``build_model(args)`` /
``build_optimizer(args, model)`` beside ``main()``, so a test can build them on the host, with
no probe, and count.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, List

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


def load(name: str) -> Any:
    """Import a corpus script as a module (its ``main()`` does not run)."""
    spec = importlib.util.spec_from_file_location(f"corpus_{name[:-3]}", script(name))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensor_bytes(tensors: List[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def expected(model: Any, optimizer_kind: str, step_on_gpu: bool = False) -> Dict[str, int]:
    """Bytes of parameters (with buffers), gradients and optimizer state on the GPU.

    Gradients: one per trainable parameter, its size. Optimizer state per trainable parameter
    (torch/optim): AdamW keeps exp_avg and exp_avg_sq of the parameter's size; SGD with
    momentum one momentum buffer, plain SGD nothing. The step counter of each parameter is a
    host tensor on the default (foreach) path and a 4-byte fp32 tensor on the GPU on the fused
    one (optimizer.py, _get_scalar_dtype; adam.py / adamw.py put ``step`` on the parameter's
    device when fused or capturable), or when a checkpoint was loaded to the GPU
    (Optimizer.load_state_dict keeps a loaded ``step`` where it is: optimizer.py,
    _process_value_according_to_param_policy): ``step_on_gpu``.
    """
    params = [p for p in model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    state_per = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}[optimizer_kind]
    state = state_per * tensor_bytes(trainable)
    if step_on_gpu and state_per == 2:
        state += 4 * len(trainable)
    return {"parameter": tensor_bytes(params) + tensor_bytes(list(model.buffers())),
            "gradient": tensor_bytes(trainable), "optimizer_state": state}
