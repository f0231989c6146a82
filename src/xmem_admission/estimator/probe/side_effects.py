"""Nothing a traced script does reaches outside the estimation: no tracker run, no Hub push.

``install`` runs in the probe's process before the script (``runner.run``: ``xmem estimate``
and the estimation pod alike). It sets the switches of ``contract.side_effects`` in the
environment (the MLflow store in the probe's scratch folder, ``XMEM_PROBE_SCRATCH``, else a
temporary folder removed when the process ends), and patches the entry points through which a
script can win over an environment variable, once the script imports each library (nothing is
imported here):

- wandb: ``wandb.init`` always gets ``mode="disabled"`` (an argument wins over
  ``WANDB_MODE``; the Trainer's ``WandbCallback`` calls ``wandb.init``), and ``WANDB_MODE`` is
  set again when wandb is imported, for a script that set its own value first;
- MLflow: the tracking URI is always the throw-away store: ``get_tracking_uri``,
  ``set_tracking_uri`` and ``_resolve_tracking_uri`` of ``mlflow.tracking._tracking_service.
  utils`` (where the fluent API, ``MlflowClient(tracking_uri=...)`` and the Trainer's
  ``MLflowCallback`` get it; patched as that module is executed, before any other takes its
  names). Redirecting rather than refusing keeps the job estimable: its runs go to the store
  and are thrown away. An experiment the script creates with its own ``artifact_location`` in
  remote storage still gets the artifacts it logs before the last traced step;
- the Hugging Face Hub: ``TrainingArguments.push_to_hub`` reads ``False`` whatever the script
  sets (transformers' ``Trainer`` creates the repository when it is made, and pushes at each
  save with ``hub_strategy="every_save"``); any other write through ``huggingface_hub``
  (``create_repo``, ``upload_file``, ``create_commit``, ``model.push_to_hub()``) is refused
  with the reason (status ``unsupported``) before its request leaves: the request hook of
  ``huggingface_hub``'s HTTP client lets reads through (a model named by its Hub id still
  downloads its configuration);
- Comet: its switches are environment variables it reads when an experiment starts; they are
  set again when ``comet_ml`` is imported;
- checkpoints: transformers' ``Trainer._save_checkpoint`` writes nothing (a ``checkpoint-N``
  folder in the job's ``output_dir`` would be on the team's volume, and a later
  ``resume_from_checkpoint=True`` would resume from the estimation's); saving moves tensors to
  the host, not GPU memory. In fake mode ``safetensors.torch.save_file``/``save`` of tensors
  without values (a PEFT adapter saved in a loop) write nothing either: their bytes do not exist
  (safetensors would read the fake tensors' memory).

Each of these, where the script used it, is a ``turned_off`` note in the trace.

Python >= 3.9, standard library only: this module ships in the probe bundle.
"""

from __future__ import annotations

import functools
import os
import secrets
import sys
import tempfile
from typing import Any, Callable, Dict, Optional, Set, Tuple
from urllib.parse import urlsplit

from xmem_admission.contract import probe_env
from xmem_admission.contract import side_effects as switches
from xmem_admission.estimator.probe.distributed import _AfterImport
from xmem_admission.estimator.probe.leave import remove_at_exit
from xmem_admission.estimator.probe.outcomes import Refused
from xmem_admission.estimator.trace import NoteKind

WANDB_NOTE = ("W&B: wandb.init ran with mode='disabled' (WANDB_MODE=disabled): no run was "
              "created, nothing was sent or written")
MLFLOW_NOTE = ("MLflow: runs went to a throw-away store in the probe's scratch folder "
               "(MLFLOW_TRACKING_URI), not to the job's tracking server")
PUSH_NOTE = ("Hugging Face Hub: push_to_hub=True turned off for the estimation: no repository "
             "was created, nothing was pushed")
CHECKPOINT_NOTE = ("checkpoints: transformers' Trainer saved no checkpoint-N folder during the "
                   "traced steps (nothing written to the job's output_dir)")
SAFETENSORS_NOTE = ("checkpoints: safetensors files of tensors without values (fake mode) were "
                    "not written")
COMET_NOTE = ("Comet: experiments disabled (COMET_AUTO_LOG_DISABLE=true, COMET_MODE=DISABLED): "
              "nothing reaches the Comet backend")

# HTTP methods that only read; a POST to ``paths-info`` is a read as well (huggingface_hub
# hf_api.py HfApi.get_paths_info: POST /api/{type}s/{id}/paths-info/{revision}).
_READS = frozenset({"GET", "HEAD", "OPTIONS"})
_READ_POSTS = ("/paths-info/",)

_WANDB = _AfterImport("wandb")
_MLFLOW = _AfterImport("mlflow.tracking._tracking_service.utils")
_HUB_HTTP = _AfterImport("huggingface_hub.utils._http")
_TRAINING_ARGS = _AfterImport("transformers.training_args")
_COMET = _AfterImport("comet_ml")
_TRAINER = _AfterImport("transformers.trainer")
_SAFETENSORS = _AfterImport("safetensors.torch")


class _Environment:
    """``os.environ`` as attributes, so that ``Patches`` sets a variable and puts it back."""

    def __getattr__(self, name: str) -> str:
        try:
            return os.environ[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: str) -> None:
        os.environ[name] = value

    def __delattr__(self, name: str) -> None:
        os.environ.pop(name, None)


_ENVIRON = _Environment()


def scratch() -> str:
    """The estimation pod's scratch folder; else (``xmem estimate``) a temporary folder of this
    run's own, made by whatever writes there first (MLflow makes its store's folder) and
    removed when the process ends."""
    folder = os.environ.get(probe_env.SCRATCH, "")
    if folder and os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
        return os.path.abspath(folder)
    own = os.path.join(tempfile.gettempdir(), f"xmem-probe-{os.getpid()}-{secrets.token_hex(8)}")
    remove_at_exit(own)
    return own


def install(patches: Any, trace: Any, fake: bool = False) -> Dict[str, str]:
    """Turn every side effect off for this run (restored with ``patches``); the switches set.
    ``fake``: the run is shape-only (its tensors have no bytes to write)."""
    env = switches.environment(scratch())
    for name, value in env.items():
        patches.set(_ENVIRON, name, value)

    said: Set[str] = set()

    def note(message: str, key: str) -> None:
        if key not in said:  # said once: how often the script met the switch does not matter
            said.add(key)
            trace.note(NoteKind.TURNED_OFF, message, key=key)

    def again(*names: str) -> None:
        """Set switches again when their library is imported: a script may have set its own."""
        for name in names:
            patches.set(_ENVIRON, name, env[name])

    hooks: Tuple[Tuple[_AfterImport, Callable[[Any], None]], ...] = (
        (_WANDB, lambda module: _wandb(patches, module, note, again)),
        (_MLFLOW, lambda module: _mlflow(patches, module, env[switches.MLFLOW_TRACKING_URI],
                                         note, again)),
        (_HUB_HTTP, lambda module: _hub_http(patches, module)),
        (_TRAINING_ARGS, lambda module: _training_args(patches, module, note)),
        (_COMET, lambda module: _comet(note, again)),
        (_TRAINER, lambda module: _trainer(patches, module, note)),
    ) + (((_SAFETENSORS, lambda module: _safetensors(patches, module, note)),) if fake else ())
    for hook, then in hooks:
        if hook.name in sys.modules:
            then(sys.modules[hook.name])
        else:
            hook.arm(patches, then)
    return env


def _wandb(patches: Any, module: Any, note: Callable[[str, str], None],
           again: Callable[..., None]) -> None:
    again("WANDB_MODE")
    init = getattr(module, "init", None)
    if not callable(init):
        return

    @functools.wraps(init)
    def disabled_init(*args: Any, **kwargs: Any) -> Any:
        kwargs["mode"] = "disabled"
        note(WANDB_NOTE, "wandb")
        return init(*args, **kwargs)

    patches.set(module, "init", disabled_init)


def _mlflow(patches: Any, utils: Any, uri: str, note: Callable[[str, str], None],
            again: Callable[..., None]) -> None:
    again(switches.MLFLOW_TRACKING_URI)
    set_uri = getattr(utils, "set_tracking_uri", None)

    def get_tracking_uri() -> str:
        note(MLFLOW_NOTE, "mlflow")
        return uri

    def resolve_tracking_uri(tracking_uri: Any = None) -> str:
        return get_tracking_uri()

    def set_tracking_uri(asked: Any) -> None:
        if set_uri is not None:
            set_uri(uri)

    for name, value in (("get_tracking_uri", get_tracking_uri),
                        ("_resolve_tracking_uri", resolve_tracking_uri),
                        ("set_tracking_uri", set_tracking_uri)):
        original = getattr(utils, name, None)
        if callable(original):
            patches.set(utils, name, functools.wraps(original)(value))


def write_refusal(method: str, url: str) -> Optional[str]:
    """Why a request through ``huggingface_hub`` is refused (a write), or None (a read)."""
    verb = method.upper()
    if verb in _READS or (verb == "POST" and any(p in urlsplit(url).path for p in _READ_POSTS)):
        return None
    parts = urlsplit(url)
    return (f"the script writes to the Hugging Face Hub ({verb} {parts.scheme}://{parts.netloc}"
            f"{parts.path}) before its last traced step; an estimation changes nothing outside "
            f"itself, so it does not send it. Push after training (Trainer(push_to_hub=True) is "
            f"turned off for the estimation), or leave the push out of the estimated script")


def _hub_http(patches: Any, http: Any) -> None:
    """Refuse writes in the request hook that every ``huggingface_hub`` client calls
    (huggingface_hub >= 1.0, utils/_http.py ``hf_request_event_hook`` in
    ``default_client_factory``; the session is made on first use, after this runs) or, before
    1.0 (requests), in its adapter's ``send`` (``UniqueRequestIdAdapter``)."""

    def check(method: Any, url: Any) -> None:
        reason = write_refusal(str(method), str(url))
        if reason is not None:
            raise Refused(reason)

    hook = getattr(http, "hf_request_event_hook", None)
    if callable(hook):
        @functools.wraps(hook)
        def request_hook(request: Any) -> Any:
            check(request.method, request.url)
            return hook(request)

        patches.set(http, "hf_request_event_hook", request_hook)
    async_hook = getattr(http, "async_hf_request_event_hook", None)
    if callable(async_hook):
        @functools.wraps(async_hook)
        async def async_request_hook(request: Any) -> Any:
            check(request.method, request.url)
            return await async_hook(request)

        patches.set(http, "async_hf_request_event_hook", async_request_hook)
    adapter = getattr(http, "UniqueRequestIdAdapter", None)
    send = getattr(adapter, "send", None) if adapter is not None else None
    if callable(send):
        @functools.wraps(send)
        def adapter_send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            check(request.method, request.url)
            return send(self, request, *args, **kwargs)

        patches.set(adapter, "send", adapter_send)


def _training_args(patches: Any, module: Any, note: Callable[[str, str], None]) -> None:
    """``TrainingArguments.push_to_hub`` (a dataclass field) becomes a property that reads
    ``False``: ``__init__``, ``set_push_to_hub()`` and a later assignment all reach it."""
    cls = getattr(module, "TrainingArguments", None)
    if cls is None:
        return

    def get(self: Any) -> bool:
        return False

    def set_(self: Any, value: Any) -> None:
        if value:
            note(PUSH_NOTE, "push_to_hub")

    patches.set(cls, "push_to_hub", property(get, set_))


def _comet(note: Callable[[str, str], None], again: Callable[..., None]) -> None:
    again(*(s.variable for s in switches.SWITCHES if s.variable.startswith("COMET_")))
    note(COMET_NOTE, "comet")


def _trainer(patches: Any, module: Any, note: Callable[[str, str], None]) -> None:
    """``Trainer._save_checkpoint`` (every transformers release: ``_save_checkpoint(model,
    trial, ...)``, called by ``_maybe_log_save_evaluate`` at each ``save_steps``) saves
    nothing."""
    cls = getattr(module, "Trainer", None)
    if cls is None or not hasattr(cls, "_save_checkpoint"):
        return

    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> None:
        note(CHECKPOINT_NOTE, "trainer-checkpoint")

    patches.set(cls, "_save_checkpoint", save_checkpoint)


def _safetensors(patches: Any, module: Any, note: Callable[[str, str], None]) -> None:
    """``save_file`` and ``save`` of safetensors.torch write nothing when a tensor has no
    value (a FakeTensor): ``save`` returns the bytes of an empty file's header instead."""

    def without_values(tensors: Any) -> bool:
        values = tensors.values() if isinstance(tensors, dict) else ()
        return any(type(t).__name__ == "FakeTensor" for t in values)

    for name in ("save_file", "save"):
        real = getattr(module, name, None)
        if real is None:
            continue

        def skipping(tensors: Any, *args: Any, __real: Any = real, __name: str = name,
                     **kwargs: Any) -> Any:
            if not without_values(tensors):
                return __real(tensors, *args, **kwargs)
            note(SAFETENSORS_NOTE, "safetensors")
            return __real({}) if __name == "save" else None

        patches.set(module, name, functools.wraps(real)(skipping))
