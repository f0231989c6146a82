"""Self-signed certificates for the xmem webhook, run by the chart's hook Jobs.

Why a script of our own: the API server only calls webhooks over TLS and must trust the serving
certificate through the caBundle of the webhook configurations. Without cert-manager, something
has to make a CA, sign a certificate for ``<service>.<namespace>.svc`` (SANs: CN-only
certificates are rejected since Kubernetes 1.19), store both in a Secret the webhook mounts, and
put the CA into both configurations. The chart mounts this file into its own image (which has
``cryptography`` and the ``kubernetes`` client) so no third-party image is pulled.

Commands:
  create    pre-install/pre-upgrade hook: make or renew the webhook's Secret (type
            kubernetes.io/tls, keys tls.crt, tls.key, ca.crt) and the CA's own Secret (ca.crt,
            ca.key; mounted by nothing). An existing CA is kept, so a renewal never invalidates
            the caBundle already in the webhook configurations; the serving certificate is
            reissued when it is missing, expires within --renew-days, or lacks a needed name.
  patch     post-install/post-upgrade hook: copy ca.crt into every webhook entry's caBundle of
            the Mutating and Validating configurations named --webhook.
  generate  write ca.crt, tls.crt and tls.key to a directory, for plain manifests and tests.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from typing import Optional, Sequence

# The certificate logic is the package's, shared with the running webhook, which renews the
# serving certificate itself (xmem_admission.cluster.admission.certificates); the hook runs in
# the chart's own image, where the package is installed.
from xmem_admission.cluster.admission.certificates import (
    CA_KEY,
    CA_PRIVATE_KEY,
    CERT_KEY,
    KEY_KEY,
    ca_patch,
    ca_still_good,
    make_ca,
    make_serving_cert,
    needs_new_serving_cert,
    plan,
    service_names,
)

__all__ = ["CA_KEY", "CA_PRIVATE_KEY", "CERT_KEY", "KEY_KEY", "ca_patch", "ca_still_good",
           "make_ca", "make_serving_cert", "needs_new_serving_cert", "plan", "service_names"]


# --- Kubernetes side (the hook Jobs) -------------------------------------------------------


def _api():
    """The kubernetes client, with the pod's service account (the hook Jobs) or, run by hand
    outside a cluster, $KUBECONFIG."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    try:
        config.load_incluster_config()
    except ConfigException:
        config.load_kube_config()
    return client


def _retry(what: str, call, attempts: int = 30, delay: float = 2.0, not_found: bool = False):
    """Retry transient API failures (the API server may be busy during an upgrade). With
    ``not_found``, a 404 is waited out too: applied as plain manifests, the patch Job can start
    before the create Job has written the Secret."""
    from kubernetes.client.exceptions import ApiException

    for attempt in range(1, attempts + 1):
        try:
            return call()
        except ApiException as exc:
            # 409 is not retried: the body is stale; the Job restarts and reads again.
            transient = exc.status == 429 or exc.status >= 500
            if not (transient or (not_found and exc.status == 404)) or attempt == attempts:
                raise
            print(f"certgen: {what}: HTTP {exc.status}, retrying", file=sys.stderr)
            time.sleep(delay)


def _read_secret(core, name: str, namespace: str):
    from kubernetes.client.exceptions import ApiException

    try:
        secret = core.read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None, {}
    return secret, {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}


def _write_secret(client, core, namespace: str, name: str, existing, kind: str, data: dict) -> None:
    body = client.V1Secret(
        metadata=client.V1ObjectMeta(
            name=name, namespace=namespace,
            labels={"app.kubernetes.io/managed-by": "xmem-certgen"},
        ),
        type=kind,
        data={k: base64.b64encode(v).decode() for k, v in data.items()},
    )
    if existing is None:
        _retry(f"create Secret {name}", lambda: core.create_namespaced_secret(namespace, body))
    else:
        # Optimistic concurrency: a concurrent writer makes this fail with 409, not vanish.
        body.metadata.resource_version = existing.metadata.resource_version
        _retry(f"replace Secret {name}",
               lambda: core.replace_namespaced_secret(name, namespace, body))


def cmd_create(args: argparse.Namespace) -> int:
    client = _api()
    core = client.CoreV1Api()
    names = service_names(args.service, args.namespace)
    # The CA key lives in its own Secret that no pod mounts: the webhook only needs its pair.
    ca_secret, ca_data = _read_secret(core, args.ca_secret, args.namespace)
    tls_secret, tls_data = _read_secret(core, args.secret, args.namespace)
    current = {CA_KEY: ca_data.get(CA_KEY), CA_PRIVATE_KEY: ca_data.get(CA_PRIVATE_KEY),
               CERT_KEY: tls_data.get(CERT_KEY), KEY_KEY: tls_data.get(KEY_KEY)}
    data, reason = plan(current, names, args.ca_days, args.cert_days, args.renew_days,
                        ca_name=f"{args.service} CA")
    if data is None and tls_data.get(CA_KEY) == ca_data.get(CA_KEY):
        print(f"certgen: Secret {args.namespace}/{args.secret}: {reason}; unchanged")
        return 0
    data = data or current
    if data[CA_KEY] != ca_data.get(CA_KEY) or data[CA_PRIVATE_KEY] != ca_data.get(CA_PRIVATE_KEY):
        _write_secret(client, core, args.namespace, args.ca_secret, ca_secret, "Opaque",
                      {CA_KEY: data[CA_KEY], CA_PRIVATE_KEY: data[CA_PRIVATE_KEY]})
    _write_secret(client, core, args.namespace, args.secret, tls_secret, "kubernetes.io/tls",
                  {CA_KEY: data[CA_KEY], CERT_KEY: data[CERT_KEY], KEY_KEY: data[KEY_KEY]})
    print(f"certgen: Secret {args.namespace}/{args.secret} written ({reason})")
    return 0


def cmd_patch(args: argparse.Namespace) -> int:
    client = _api()
    core = client.CoreV1Api()
    admission = client.AdmissionregistrationV1Api()
    secret = _retry("read secret", lambda: core.read_namespaced_secret(args.secret, args.namespace),
                    not_found=True)
    ca_b64 = (secret.data or {}).get(CA_KEY)
    if not ca_b64:
        print(f"certgen: Secret {args.namespace}/{args.secret} has no {CA_KEY}", file=sys.stderr)
        return 1
    for kind, read, patch in (
        ("MutatingWebhookConfiguration", admission.read_mutating_webhook_configuration,
         admission.patch_mutating_webhook_configuration),
        ("ValidatingWebhookConfiguration", admission.read_validating_webhook_configuration,
         admission.patch_validating_webhook_configuration),
    ):
        config = _retry(f"read {kind}", lambda read=read: read(args.webhook), not_found=True)
        ops = ca_patch(config.webhooks or [], ca_b64)
        # A list body makes the client send application/json-patch+json.
        _retry(f"patch {kind}", lambda patch=patch, ops=ops: patch(args.webhook, ops))
        print(f"certgen: {kind}/{args.webhook}: caBundle set on {len(ops) // 2} webhooks")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    data, _ = plan({}, service_names(args.service, args.namespace), args.ca_days,
                   args.cert_days, args.renew_days, ca_name=f"{args.service} CA")
    os.makedirs(args.out, exist_ok=True)
    for key in (CA_KEY, CERT_KEY, KEY_KEY):
        path = os.path.join(args.out, key)
        with open(path, "wb") as handle:
            handle.write(data[key])
        if key == KEY_KEY:
            os.chmod(path, 0o600)
    print(f"certgen: wrote {CA_KEY}, {CERT_KEY}, {KEY_KEY} to {args.out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="certgen", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func in (("create", cmd_create), ("patch", cmd_patch), ("generate", cmd_generate)):
        p = sub.add_parser(name)
        p.set_defaults(func=func)
        p.add_argument("--namespace", required=True)
        if name in ("create", "patch"):
            p.add_argument("--secret", required=True, help="the webhook's TLS Secret")
        if name == "create":
            p.add_argument("--ca-secret", required=True, help="the CA's Secret (with its key)")
        if name in ("create", "generate"):
            p.add_argument("--service", required=True)
            p.add_argument("--ca-days", type=int, default=3650)
            p.add_argument("--cert-days", type=int, default=365)
            p.add_argument("--renew-days", type=int, default=30)
        if name == "patch":
            p.add_argument("--webhook", required=True, help="name of both configurations")
        if name == "generate":
            p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
