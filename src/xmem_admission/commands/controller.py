"""``xmem controller``: estimate held workloads in estimation pods and release them.

Runs in the cluster (in-cluster credentials) or anywhere with a kubeconfig. Every option can also
come from an environment variable (the Helm chart sets those), the flag winning. Several replicas
may run: one leads through a coordination.k8s.io Lease, the others stand by. A leader that cannot
renew in time stops reconciling and stands by again, in the same process.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from typing import Any, Optional

from xmem_admission.commands.help_format import DefaultsShown
from xmem_admission.contract.errors import ControllerError, KubeUnavailable

ENV = {
    "kubeconfig": "KUBECONFIG",
    "policy": "XMEM_POLICY",
    "policy_name": "XMEM_POLICY_NAME",
    "probe_image": "XMEM_PROBE_IMAGE",
    "lease_name": "XMEM_LEASE_NAME",
    "lease_namespace": "XMEM_LEASE_NAMESPACE",
    "identity": "XMEM_POD_NAME",
    "host": "XMEM_HOST",
    "metrics_port": "XMEM_METRICS_PORT",
    "workloads": "XMEM_WORKLOADS",
    "resync_seconds": "XMEM_RESYNC_SECONDS",
    "reload_seconds": "XMEM_RELOAD_SECONDS",
    "log_level": "XMEM_LOG_LEVEL",
    "kueue_controller_name": "XMEM_KUEUE_CONTROLLER_NAME",
}
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _env(dest: str, default: Optional[str] = None) -> Optional[str]:
    return os.environ.get(ENV[dest], default)


def register(subparsers: Any) -> None:
    """Add the ``controller`` subcommand to the ``xmem`` parser."""
    parser = subparsers.add_parser(
        "controller",
        formatter_class=DefaultsShown,
        help="estimate held workloads in estimation pods and release them",
        description="Watch workloads the webhook holds, run one estimation pod per workload "
        "fingerprint, record GPUMemoryEstimates, write the request into the pod templates and "
        "release the workloads (or apply the policy's failure action). Each option also reads "
        "the environment variable shown in its help.",
    )
    add = parser.add_argument
    add("--kubeconfig", default=_env("kubeconfig"),
        help="kubeconfig when not running in a cluster [KUBECONFIG]")
    add("--policy", metavar="FILE.yaml", default=_env("policy"),
        help="GPUAdmissionPolicy YAML file; without it the cluster's GPUAdmissionPolicy "
        "[XMEM_POLICY]")
    add("--policy-name", default=_env("policy_name", "default"),
        help="name of the cluster's GPUAdmissionPolicy [XMEM_POLICY_NAME]")
    # Required: an estimation pod cannot be built without it, and no image is published under a
    # name this project could default to. The chart sets the environment variable.
    add("--probe-image", metavar="IMAGE", default=_env("probe_image"),
        required=not _env("probe_image"),
        help="required unless XMEM_PROBE_IMAGE is set: the image of the init container that "
        "installs the probe bundle in estimation pods (this project's image, the one the "
        "controller runs from) [XMEM_PROBE_IMAGE]")
    add("--lease-name", default=_env("lease_name", "xmem-xmem-admission-controller"),
        help="Lease used for leader election; the default is the one the chart's Role allows "
        "(release xmem) [XMEM_LEASE_NAME]")
    add("--lease-namespace", default=_env("lease_namespace"),
        help="namespace of the Lease (default: this pod's namespace, else 'default') "
        "[XMEM_LEASE_NAMESPACE]")
    add("--identity", default=_env("identity"),
        help="this replica's identity in the Lease (default: host name and a random suffix) "
        "[XMEM_POD_NAME]")
    add("--no-leader-election", action="store_true",
        help="reconcile without a Lease (a single replica only)")
    add("--lease-duration", type=float, default=15.0,
        help="seconds a standby waits after the leader's last renewal before taking over")
    add("--renew-deadline", type=float, default=10.0,
        help="seconds the leader keeps leading without a successful renewal")
    add("--retry-period", type=float, default=2.0,
        help="seconds between attempts to acquire or renew the Lease")
    add("--host", default=_env("host", "0.0.0.0"), help="metrics address [XMEM_HOST]")
    add("--metrics-port", type=int, default=_env("metrics_port", "8080"),
        help="port of /metrics, /healthz, /readyz (0: pick one) [XMEM_METRICS_PORT]")
    add("--workloads", default=_env("workloads", "Job,PyTorchJob,JobSet,TrainJob"),
        help="workload kinds to release, comma-separated [XMEM_WORKLOADS]")
    add("--resync-seconds", type=float, default=_env("resync_seconds", "30"),
        help="how often every held workload is looked at again [XMEM_RESYNC_SECONDS]")
    add("--reload-seconds", type=float, default=_env("reload_seconds", "2"),
        help="how often the policy is checked for changes [XMEM_RELOAD_SECONDS]")
    add("--lease-unready-seconds", type=float, default=30.0,
        help="after how long of being refused its Lease (401/403) a replica reports not ready")
    add("--log-level", default=_env("log_level", "info"),
        choices=("debug", "info", "warning", "error"), help="how much to log [XMEM_LOG_LEVEL]")
    add("--kueue-controller-name", default=_env("kueue_controller_name", ""),
        metavar="NAME", help="serve Kueue AdmissionChecks with this spec.controllerName "
        "(xmem.io/gpu-memory in the chart; empty: Kueue is not used) "
        "[XMEM_KUEUE_CONTROLLER_NAME]")
    parser.set_defaults(func=run)


def _api_client(kubeconfig: Optional[str]) -> Any:
    from xmem_admission.cluster.kube.kubeconfig import api_client
    from xmem_admission.contract.errors import NoClusterCredentials

    try:
        return api_client(kubeconfig)
    except NoClusterCredentials as exc:
        raise ControllerError(f"no cluster credentials: run in a pod, or pass --kubeconfig "
                              f"({exc})") from None


def _lease_namespace(value: Optional[str]) -> str:
    if value:
        return value
    try:
        with open(SA_NAMESPACE, encoding="utf-8") as handle:
            return handle.read().strip() or "default"
    except OSError:
        return "default"


def run(args: argparse.Namespace) -> int:
    from xmem_admission.cluster.controller.manager import KINDS, Controller, HealthServer
    from xmem_admission.cluster.controller.metrics import ControllerMetrics
    from xmem_admission.cluster.kube.client import Kube
    from xmem_admission.cluster.kube.leader import LeaderElector
    from xmem_admission.cluster.policy.sources import ClusterPolicySource, FilePolicySource

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.probe_image:
        raise ControllerError("--probe-image (or XMEM_PROBE_IMAGE) is required: the image whose "
                              "init container installs the probe in estimation pods")
    kinds = [k.strip() for k in args.workloads.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ControllerError(f"--workloads: unknown kind {unknown[0] if unknown else '(none)'}; "
                              f"choose from {', '.join(KINDS)}")
    api_client = _api_client(args.kubeconfig)
    kube = Kube(api_client)
    metrics = ControllerMetrics()

    def on_policy_error(reason: str) -> None:
        logging.getLogger("xmem.controller").error("policy %s error", reason)

    policy: Any = (FilePolicySource(args.policy, on_error=on_policy_error) if args.policy else
                   ClusterPolicySource(api_client, args.policy_name, on_error=on_policy_error))
    identity = args.identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    controller = Controller(kube, policy, args.probe_image, kinds=kinds, metrics=metrics,
                            identity=identity, resync_seconds=args.resync_seconds,
                            policy_seconds=args.reload_seconds,
                            kueue_check=args.kueue_controller_name or None)
    try:
        elector = None if args.no_leader_election else LeaderElector(
            kube, _lease_namespace(args.lease_namespace), args.lease_name, identity,
            lease_duration=args.lease_duration, renew_deadline=args.renew_deadline,
            retry_period=args.retry_period, unready_after=args.lease_unready_seconds,
            on_error=lambda code: metrics.lease_errors.labels(code).inc())
    except ValueError as exc:
        raise ControllerError(f"--renew-deadline/--lease-duration: {exc}") from None
    try:
        health = HealthServer(controller, args.host, args.metrics_port, elector).start()
    except OSError as exc:
        raise ControllerError(f"cannot listen on {args.host}:{args.metrics_port}: {exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    where = args.policy or f"GPUAdmissionPolicy/{args.policy_name}"
    print(f"xmem controller: {identity} watching {', '.join(kinds)}; policy {where}; "
          f"metrics on http://{args.host}:{health.port}/metrics", file=sys.stderr, flush=True)
    try:
        controller.run(stop, elector)
    except KubeUnavailable as exc:
        raise ControllerError(f"the API server is not answering: {exc}") from None
    finally:
        health.stop()
    return 0
