"""``xmem serve``: the admission webhook (TLS) with its health and metrics port.

Every option can also come from an environment variable (the Helm chart sets those), the flag
winning. With ``--policy`` it runs stand-alone (tests, demos); without it the policy is the
cluster's ``GPUAdmissionPolicy`` (in-cluster credentials, else ``--kubeconfig``/``$KUBECONFIG``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, List, Optional, Tuple

from xmem_admission.cluster.admission.trust import (
    DEFAULT_CONTROLLER_USER,
    DEFAULT_KUEUE_USERS,
    DEFAULT_WORKLOAD_CONTROLLERS,
)
from xmem_admission.commands.help_format import DefaultsShown
from xmem_admission.contract.errors import ServeError

ENV = {
    "cert_file": "XMEM_CERT_FILE",
    "key_file": "XMEM_KEY_FILE",
    "host": "XMEM_HOST",
    "port": "XMEM_PORT",
    "metrics_port": "XMEM_METRICS_PORT",
    "policy": "XMEM_POLICY",
    "policy_name": "XMEM_POLICY_NAME",
    "kubeconfig": "KUBECONFIG",
    "estimates": "XMEM_ESTIMATES",
    "reload_seconds": "XMEM_RELOAD_SECONDS",
    "log_level": "XMEM_LOG_LEVEL",
    "controller_users": "XMEM_CONTROLLER_USERS",
    "workload_controllers": "XMEM_WORKLOAD_CONTROLLERS",
    "hold": "XMEM_HOLD",
    "kueue_users": "XMEM_KUEUE_USERS",
    "break_glass_groups": "XMEM_BREAK_GLASS_GROUPS",
    "cert_secret": "XMEM_CERT_SECRET",
    "ca_secret": "XMEM_CA_SECRET",
    "cert_namespace": "XMEM_CERT_NAMESPACE",
    "cert_service": "XMEM_CERT_SERVICE",
    "webhook_configuration": "XMEM_WEBHOOK_CONFIGURATION",
    "ca_days": "XMEM_CA_DAYS",
    "cert_days": "XMEM_CERT_DAYS",
    "renew_days": "XMEM_RENEW_DAYS",
    "cert_check_seconds": "XMEM_CERT_CHECK_SECONDS",
    "cert_extra_names": "XMEM_CERT_EXTRA_NAMES",
}


def _env(dest: str, default: Optional[str] = None) -> Optional[str]:
    return os.environ.get(ENV[dest], default)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        formatter_class=DefaultsShown,
        help="run the admission webhook (HTTPS) and its metrics/health port",
        description="Serve /mutate and /validate (AdmissionReview v1) over TLS and /metrics, "
        "/healthz, /readyz over plain HTTP. Each option also reads the environment variable "
        "shown in its help.",
    )
    add = parser.add_argument
    add("--cert-file", default=_env("cert_file"), help="serving certificate, PEM [XMEM_CERT_FILE]")
    add("--key-file", default=_env("key_file"), help="its private key, PEM [XMEM_KEY_FILE]")
    add("--host", default=_env("host", "0.0.0.0"), help="address to listen on [XMEM_HOST]")
    add("--port", type=int, default=_env("port", "8443"), help="admission port [XMEM_PORT]")
    add("--metrics-port", type=int, default=_env("metrics_port", "8080"),
        help="metrics and health port [XMEM_METRICS_PORT]")
    add("--policy", metavar="FILE.yaml", default=_env("policy"),
        help="GPUAdmissionPolicy YAML file, reloaded on change; without it the cluster's "
        "GPUAdmissionPolicy is used [XMEM_POLICY]")
    add("--policy-name", default=_env("policy_name", "default"),
        help="name of the cluster's GPUAdmissionPolicy [XMEM_POLICY_NAME]")
    add("--kubeconfig", default=_env("kubeconfig"),
        help="kubeconfig when not running in a cluster [KUBECONFIG]")
    add("--estimates", metavar="DIR", default=_env("estimates"),
        help="directory of estimate JSON files to seed the in-memory store [XMEM_ESTIMATES]")
    add("--reload-seconds", type=float, default=_env("reload_seconds", "2"),
        help="how often certificate and policy are checked for changes [XMEM_RELOAD_SECONDS]")
    add("--log-level", default=_env("log_level", "info"),
        choices=("debug", "info", "warning", "error"), help="how much to log [XMEM_LOG_LEVEL]")
    add("--controller-user", dest="controller_users", metavar="USER[,USER]",
        default=_env("controller_users", DEFAULT_CONTROLLER_USER),
        help="user name(s) of the xmem controller's service account: the only requester whose "
        "xmem.io/ annotations are believed and who may release a held workload "
        "[XMEM_CONTROLLER_USERS]")
    add("--workload-controller", dest="workload_controllers", metavar="USER[,USER]",
        default=_env("workload_controllers", ",".join(DEFAULT_WORKLOAD_CONTROLLERS)),
        help="users that create pods for workloads (the Job controller, training operators; a "
        "trailing * matches a prefix): only their pods count as owned and carry believed "
        "sizing annotations [XMEM_WORKLOAD_CONTROLLERS]")
    add("--kueue-user", dest="kueue_users", metavar="USER[,USER]",
        default=_env("kueue_users", ",".join(DEFAULT_KUEUE_USERS)),
        help="Kueue's user name(s): under the policy's integration Kueue, they may write the "
        "AdmissionCheck's sizing annotations into a queued workload and unsuspend it "
        "[XMEM_KUEUE_USERS]")
    add("--break-glass-group", dest="break_glass_groups", metavar="GROUP", action="append",
        default=None,
        help="a group (from the requester's userInfo.groups) whose members may admit a workload "
        "unchanged where the policy enforces, with the annotation xmem.io/break-glass: REASON; "
        "repeatable; none by default: the annotation is then ignored "
        "[XMEM_BREAK_GLASS_GROUPS, comma-separated]")
    add("--no-hold", dest="hold", action="store_false",
        default=(_env("hold", "true") or "true").lower() not in ("false", "0", "no"),
        help="never hold a workload (no controller runs to release it): one without a recorded "
        "estimate is admitted with a warning, or denied where the policy enforces "
        "[XMEM_HOLD=false]")
    rotation = parser.add_argument_group(
        "self-signed certificate rotation",
        "With --cert-secret, the webhook renews its serving certificate in that Secret before "
        "it expires (signed by the CA in --ca-secret), serves the Secret's pair as soon as it "
        "changes, and keeps the CA in the caBundle of the webhook configurations (the chart "
        "sets these with certificates.mode selfSigned).")
    add = rotation.add_argument
    add("--cert-secret", default=_env("cert_secret"),
        help="the kubernetes.io/tls Secret of the serving certificate [XMEM_CERT_SECRET]")
    add("--ca-secret", default=_env("ca_secret"),
        help="the Secret with the CA and its key (ca.crt, ca.key) [XMEM_CA_SECRET]")
    add("--cert-namespace", default=_env("cert_namespace"),
        help="the Secrets' namespace [XMEM_CERT_NAMESPACE]")
    add("--cert-service", default=_env("cert_service"),
        help="the webhook's Service, whose DNS names the certificate carries [XMEM_CERT_SERVICE]")
    add("--webhook-configuration", default=_env("webhook_configuration"),
        help="the name of the Mutating and Validating webhook configurations whose caBundle "
        "holds the CA [XMEM_WEBHOOK_CONFIGURATION]")
    add("--ca-days", type=float, default=_env("ca_days", "3650"),
        help="validity of a renewed CA [XMEM_CA_DAYS]")
    add("--cert-days", type=float, default=_env("cert_days", "365"),
        help="validity of a renewed serving certificate [XMEM_CERT_DAYS]")
    add("--renew-days", type=float, default=_env("renew_days", "30"),
        help="renew when the certificate (or the CA) expires within this [XMEM_RENEW_DAYS]")
    add("--cert-check-seconds", type=float, default=_env("cert_check_seconds", "60"),
        help="how often the Secret is checked [XMEM_CERT_CHECK_SECONDS]")
    add("--cert-extra-name", dest="cert_extra_names", action="append", default=None,
        help="another DNS name for the certificate, besides the Service's (a webhook called "
        "by URL); repeatable [XMEM_CERT_EXTRA_NAMES, comma-separated]")
    parser.set_defaults(func=run)


def _users(text: str) -> Tuple[str, ...]:
    return tuple(u.strip() for u in (text or "").split(",") if u.strip())


def _break_glass_groups(given: Optional[List[str]]) -> Tuple[str, ...]:
    """The flag's groups (each may also list several, comma-separated), else the environment's."""
    groups = _users(",".join(given)) if given else _users(_env("break_glass_groups") or "")
    return tuple(dict.fromkeys(groups))


def _cluster_api(args: argparse.Namespace) -> Any:
    from xmem_admission.cluster.kube.kubeconfig import api_client
    from xmem_admission.contract.errors import NoClusterCredentials

    try:
        return api_client(args.kubeconfig)
    except NoClusterCredentials as exc:
        raise ServeError(
            "no policy: pass --policy FILE.yaml, or run where cluster credentials exist "
            f"(in a pod, or with a kubeconfig) ({exc})"
        ) from None


def _cluster_store(api: Any) -> Any:
    """In a cluster: the GPUMemoryEstimate resources the controller records, watched into memory.

    The watch fills the store in the background: until it has synced, a workload simply finds no
    estimate and is held, and the controller reuses the recorded estimate for its fingerprint.
    """
    from xmem_admission.cluster.controller.gme_store import KubeStore
    from xmem_admission.cluster.kube.client import Kube

    store = KubeStore(Kube(api))
    store.informer.start()
    return store


def _config_maps(api: Any) -> Any:
    """In a cluster: every ConfigMap's name, uid and resourceVersion (a metadata-only watch, no
    data), which the fingerprint reads (``policy.fingerprint``); None stand-alone."""
    if api is None:
        return None
    from xmem_admission.cluster.kube.client import CONFIG_MAP, Kube
    from xmem_admission.cluster.kube.informer import Informer

    informer = Informer(Kube(api), CONFIG_MAP, metadata_only=True).start()
    informer.synced.wait(30)  # a review before it has synced reads ConfigMaps by name only
    return informer


def _reader(api: Any) -> Any:
    """The API reads the webhook makes (a TrainJob's runtime), None without cluster access."""
    if api is None:
        return None
    from xmem_admission.cluster.kube.client import Kube

    return Kube(api, attempts=2)


def _rotation(args: argparse.Namespace, api: Any) -> Tuple[Any, Any]:
    """The certificate rotator and the files it serves from, or (None, None) without
    --cert-secret."""
    if not args.cert_secret:
        return None, None
    missing = [flag for flag, value in (("--ca-secret", args.ca_secret),
                                        ("--cert-namespace", args.cert_namespace),
                                        ("--cert-service", args.cert_service),
                                        ("--webhook-configuration", args.webhook_configuration))
               if not value]
    if missing:
        raise ServeError(f"--cert-secret needs {', '.join(missing)} too")
    if api is None:
        raise ServeError("--cert-secret needs cluster access: it is not for --policy FILE")
    if args.renew_days >= args.cert_days:
        raise ServeError(f"--renew-days ({args.renew_days:g}) must be shorter than --cert-days "
                         f"({args.cert_days:g}), or every check would renew")
    from xmem_admission.cluster.admission.certificates import FilePair, Rotator

    extra = _users(",".join(args.cert_extra_names)) if args.cert_extra_names \
        else _users(_env("cert_extra_names") or "")
    rotated = FilePair()
    rotator = Rotator(api, args.cert_namespace, args.cert_secret, args.ca_secret,
                      args.cert_service, args.webhook_configuration, rotated,
                      ca_days=args.ca_days, cert_days=args.cert_days,
                      renew_days=args.renew_days, extra_names=extra)
    return rotator, rotated


def run(args: argparse.Namespace) -> int:
    from xmem_admission.cluster.admission.metrics import AdmissionMetrics
    from xmem_admission.cluster.admission.server import AdmissionServer, ServeConfig
    from xmem_admission.cluster.admission.server import run as serve_forever
    from xmem_admission.cluster.admission.trust import Trust
    from xmem_admission.cluster.admission.webhook import Webhook
    from xmem_admission.cluster.policy.sources import ClusterPolicySource, FilePolicySource
    from xmem_admission.cluster.policy.store import MemoryStore

    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.cert_file or not args.key_file:
        raise ServeError("--cert-file and --key-file are required (or XMEM_CERT_FILE/XMEM_KEY_FILE)")
    metrics = AdmissionMetrics()

    def on_error(reason: str) -> None:
        metrics.policy_errors.labels(reason).inc()

    api = None if args.policy else _cluster_api(args)
    if args.policy:
        policy: Any = FilePolicySource(args.policy, on_error=on_error)
        where = args.policy
    else:
        policy = ClusterPolicySource(api, args.policy_name, on_error=on_error)
        where = f"GPUAdmissionPolicy/{args.policy_name}"
    if api is None or args.estimates:
        # Stand-alone: an in-memory store, seeded from estimate files when given.
        store: Any = (MemoryStore.from_directory(args.estimates) if args.estimates
                      else MemoryStore())
    else:
        store = _cluster_store(api)
    trust = Trust(controller_users=_users(args.controller_users),
                  workload_controllers=_users(args.workload_controllers),
                  kueue_users=_users(args.kueue_users),
                  break_glass_groups=_break_glass_groups(args.break_glass_groups))
    if args.hold and not trust.controller_users:
        raise ServeError("--controller-user is empty: nothing could release a held workload; "
                         "name the controller's service account or pass --no-hold")
    config_maps = _config_maps(api)
    rotator, rotated = _rotation(args, api)
    server = AdmissionServer(
        Webhook(policy, store, metrics, trust=trust, hold=args.hold, reader=_reader(api),
                versions=config_maps.versions if config_maps is not None else None),
        policy,
        ServeConfig(
            cert_file=args.cert_file, key_file=args.key_file, host=args.host, port=args.port,
            metrics_port=args.metrics_port, reload_seconds=args.reload_seconds,
            log_level=args.log_level,
        ),
        rotator=rotator, rotated=rotated, rotate_seconds=args.cert_check_seconds,
    )
    port, health_port = server.ports
    print(
        f"xmem serve: admission on https://{args.host}:{port} (/mutate, /validate), "
        f"health on http://{args.host}:{health_port} (/metrics, /healthz, /readyz); "
        f"policy {where}; {len(store)} recorded estimates; "
        + (f"holds workloads for {', '.join(trust.controller_users)}" if args.hold
           else "never holds (--no-hold)")
        + (f"; break-glass for groups {', '.join(trust.break_glass_groups)}"
           if trust.break_glass_groups else "; no break-glass group"),
        file=sys.stderr, flush=True,
    )
    serve_forever(server)
    return 0
