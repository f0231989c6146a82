"""How an estimation pod ended: its result, or a failure reason and a message.

``classify`` reads a pod of one estimate: the probe's result in the main container's
termination message, else why the pod failed or cannot start (an image that cannot be pulled, a
container that cannot be configured or started, the probe's init container, a memory limit, the
deadline), with the script's last log lines where the kubelet kept them. ``batches`` reads each
estimate's own entry in a pod that carries several; both return an ``Outcome``, which
``estimation_pods`` records.

Failure reasons: ``ScriptFailed``, ``NoOptimizerStep``, ``NeedsRealValues``, ``Unsupported``,
``ProbeError``, ``TorchNotFound``, ``NoResult``, ``OOMKilled``, ``DeadlineExceeded``,
``ImagePullFailed``, ``ContainerConfigError``, ``CannotStart``, ``ImageEnvUnreadable``,
``ProbeInjectionFailed``, ``Error``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from xmem_admission.cluster.controller import podspec
from xmem_admission.cluster.kube.client import Obj
from xmem_admission.contract import termination
from xmem_admission.contract.errors import TerminationMessageError

if TYPE_CHECKING:
    from xmem_admission.cluster.controller.context import Context

IMAGE_PULL_FAILURES = ("ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONFIG_FAILURES = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
# A container whose process never started: containerd's reason (kubelet kuberuntime,
# reason from the CRI status), and dockershim's / cri-dockerd's.
START_FAILURES = ("StartError", "ContainerCannotRun")
STATUS_REASONS = {"script_error": "ScriptFailed", "no_step": "NoOptimizerStep",
                  "needs_real_values": "NeedsRealValues", "unsupported": "Unsupported",
                  "probe_error": "ProbeError", "no_torch": "TorchNotFound",
                  "deadline_exceeded": "DeadlineExceeded", "oom_killed": "OOMKilled"}


@dataclass(frozen=True)
class Outcome:
    """How an estimation pod ended: a result, or a failure reason and message."""

    result: Optional[termination.Result] = None
    reason: str = ""
    message: str = ""


def statuses(pod: Obj, field: str) -> List[Dict[str, Any]]:
    """The pod's container statuses of one kind (``containerStatuses``,
    ``initContainerStatuses``)."""
    return (pod.get("status") or {}).get(field) or []


def main_status(pod: Obj) -> Dict[str, Any]:
    """The status of the container that runs the probe (the pod's first)."""
    name = pod["spec"]["containers"][0]["name"]
    for status in statuses(pod, "containerStatuses"):
        if status.get("name") == name:
            return status
    return {}


def _tail(ctx: Context, pod: Obj, container: Optional[str] = None) -> str:
    """The last lines a failed container printed: the kubelet puts them in its termination
    message when it wrote no result (``FallbackToLogsOnError``), so the controller needs no
    right to read any pod's logs."""
    name = container or pod["spec"]["containers"][0]["name"]
    text = ""
    for status in statuses(pod, "initContainerStatuses") + statuses(pod, "containerStatuses"):
        if status.get("name") == name:
            message = ((status.get("state") or {}).get("terminated") or {}).get("message") or ""
            if _decoded(message) is None:
                text = "\n".join(str(message).strip().splitlines()[-ctx.log_lines:])
    return f"; last log lines:\n{text}" if text else ""


def _decoded(message: Optional[str]) -> Optional[termination.Result]:
    try:
        return termination.decode(message)
    except TerminationMessageError:
        return None


def classify(ctx: Context, pod: Obj) -> Optional[Outcome]:
    """The outcome of an estimation pod, or None while it is still on its way."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    main = main_status(pod)
    terminated = (main.get("state") or {}).get("terminated") or {}
    result = _decoded(terminated.get("message"))
    if phase == "Succeeded":
        if result is not None and result.ok:
            return Outcome(result=result)
        if result is not None:
            return _failed_result(ctx, pod, result)
        return Outcome(reason="NoResult", message="the estimation container exited 0 without a "
                       "result: did the command start Python with the probe on PYTHONPATH?"
                       + _tail(ctx, pod))
    if phase == "Failed":
        limit = pod["spec"].get("activeDeadlineSeconds")
        if status.get("reason") == "DeadlineExceeded":
            return Outcome(reason="DeadlineExceeded", message=f"the estimation did not finish "
                           f"within activeDeadlineSeconds={limit}" + _tail(ctx, pod))
        for init in statuses(pod, "initContainerStatuses"):
            ended = (init.get("state") or {}).get("terminated") or {}
            code = ended.get("exitCode")
            if code in (None, 0):
                continue
            how = f"exit code {code}, {ended.get('reason') or 'no reason'}"
            if init.get("name") == podspec.IMAGE_ENV_NAME:
                spec: Dict[str, Any] = next((c for c in pod["spec"].get("initContainers") or []
                                       if c.get("name") == podspec.IMAGE_ENV_NAME), {})
                python = (spec.get("command") or ["python3"])[0]
                return Outcome(reason="ImageEnvUnreadable", message=f"the init container that "
                               f"reads the image's PYTHONPATH with {python!r} from image "
                               f"{init.get('image')!r} failed ({how}): the image needs that "
                               "Python (start the workload's command with the interpreter, or "
                               "set PYTHONPATH in the pod spec)"
                               + _tail(ctx, pod, init.get("name")))
            return Outcome(reason="ProbeInjectionFailed", message="the init container that "
                           f"installs the probe failed ({how})"
                           + _tail(ctx, pod, init.get("name")))
        if terminated.get("reason") == "OOMKilled":
            memory = pod["spec"]["containers"][0]["resources"]["limits"].get("memory")
            return Outcome(reason="OOMKilled", message=f"the estimation pod exceeded its memory "
                           f"limit ({memory}): raise spec.estimation.resources.memory in the "
                           "policy, or use fake mode (spec.estimation.mode)" + _tail(ctx, pod))
        if result is not None and not result.ok:
            return _failed_result(ctx, pod, result)
        if terminated.get("reason") in START_FAILURES:
            # the runtime's own words (kubelet: the CRI error as the termination message)
            return Outcome(reason="CannotStart", message="the estimation container could not "
                           f"start its command {_command(pod)}: "
                           f"{str(terminated.get('message') or '').strip()[-1000:]}")
        code = terminated.get("exitCode")
        return Outcome(reason="Error", message=f"the estimation container failed (exit code "
                       f"{code}, {terminated.get('reason') or 'no reason'})" + _tail(ctx, pod))
    for item in statuses(pod, "initContainerStatuses") + statuses(pod, "containerStatuses"):
        waiting = (item.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL_FAILURES:
            return Outcome(reason="ImagePullFailed", message=f"cannot pull image "
                           f"{item.get('image')!r} ({waiting.get('reason')}): "
                           f"{waiting.get('message', '')}".rstrip(": "))
        if waiting.get("reason") in CONFIG_FAILURES:
            return Outcome(reason="ContainerConfigError", message=f"container "
                           f"{item.get('name')!r} cannot start ({waiting.get('reason')}): "
                           f"{waiting.get('message', '')}".rstrip(": "))
    return None


def _command(pod: Obj) -> str:
    container = pod["spec"]["containers"][0]
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    return repr(" ".join(argv)[:200]) if argv else "(the image's ENTRYPOINT and CMD)"


def _failed_result(ctx: Context, pod: Obj, result: termination.Result) -> Outcome:
    text = result.reason
    if result.traceback:
        text += "\n" + "\n".join(result.traceback.strip().splitlines()[-ctx.log_lines:])
    else:
        text += _tail(ctx, pod)
    return Outcome(reason=STATUS_REASONS.get(result.status, "Error"), message=text)
