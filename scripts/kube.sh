#!/usr/bin/env bash
# Start or stop a bare real control plane on loopback (etcd, kube-apiserver with RBAC,
# kube-controller-manager, kube-scheduler), built by scripts/build-kube.sh (`make tools`).
#
#   scripts/kube.sh up DIR     # certificates, processes, logs and kubeconfig under DIR;
#                              # prints DIR/admin.kubeconfig
#   scripts/kube.sh down DIR   # stops the processes DIR/run/*.pid names, in a safe order
#
# The same code as the tests' session fixture (localkube/controlplane.py).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ $# -eq 2 ] || { echo "usage: $0 up|down DIR" >&2; exit 2; }
cd "$ROOT"
exec "$PY" -m localkube.controlplane "$1" "$2"
