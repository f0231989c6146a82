#!/usr/bin/env bash
# Build the real Kubernetes control plane the cluster tests and the playground run on, once per set
# of versions, into a cache outside the clone:
#
#   kube-apiserver, kube-controller-manager, kube-scheduler   k8s.io/kubernetes
#   etcd                                                      go.etcd.io/etcd/server/v3
#   kwok                                                      sigs.k8s.io/kwok (fake GPU nodes)
#   kwok-stages/*.yaml      node-fast, heartbeat-with-lease and pod-fast Stages, from kwok's module
#   crds/*.yaml             Kubeflow PyTorchJob, prometheus-operator ServiceMonitor/PrometheusRule
#                           and cert-manager CRDs, from those projects' modules
#
# Versions: scripts/kube-versions.env (the only place they are written). Everything comes from the
# Go module proxy through the machine's `go`; nothing else is downloaded.
#
# k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces every staging module
# (k8s.io/api, k8s.io/client-go, ...) with a folder inside its own tree. So it is built from a small
# generated wrapper module whose replace lines, generated from that go.mod, point each staging
# module at its published v0.X.Y. etcd's server module has folder replaces of the same kind, so it
# gets a wrapper module too.
#
# Cache: $XMEM_KUBE_CACHE (default ~/.cache/xmem-admission/kube)/<key>/, the key made of the
# versions, so CI on the same machine reuses it and a cold machine builds once. The temporary Go
# module and build caches (several GB) live in <cache>/.build-<key>/ while building, so an
# interrupted build resumes, and are deleted when the build succeeds. .tools/kube links to the
# cache entry. A second `make tools` while one is building waits for it (flock).
#
# Measured on 2 cores: 1431 s cold with an empty cache (2026-12-01, beside a single-core job);
# 46 min earlier on cores shared with other builds (load 9-10: etcd and kwok 14 min,
# kube-apiserver, controller-manager and scheduler 32 min); 0.2 s warm; 350 MB of
# binaries. Deleting the temporary caches (about 5 GB) takes a few minutes on a busy disk.
set -euo pipefail

# shellcheck source=go-cache.sh
source "$(dirname "$0")/go-cache.sh"
# shellcheck source=kube-versions.env
source "$ROOT/scripts/kube-versions.env"
cache_begin kube "${XMEM_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/xmem-admission/kube}" \
  "k8s-${KUBERNETES_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_to-${TRAINING_OPERATOR_VERSION}_po-${PROMETHEUS_OPERATOR_VERSION}_cm-${CERT_MANAGER_VERSION}_r${KUBE_BUILD_RECIPE}"
mkdir -p "$DEST/bin" "$DEST/kwok-stages" "$DEST/crds"

k8s_minor="${KUBERNETES_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
k8s_patch="${KUBERNETES_VERSION##*.}"
staging_version="v0.${k8s_minor}.${k8s_patch}"

# --- k8s.io/kubernetes -------------------------------------------------------------------------
build_kubernetes() {
  local bins=(kube-apiserver kube-controller-manager kube-scheduler) missing=0 b
  for b in "${bins[@]}"; do [ -x "$DEST/bin/$b" ] || missing=1; done
  [ "$missing" = 1 ] || return 0
  local mod="$WORK/wrap-kubernetes"
  mkdir -p "$mod"
  log "k8s.io/kubernetes $KUBERNETES_VERSION (staging modules at $staging_version)"
  # The upstream go.mod, for its replace block.
  local upstream
  upstream="$("$GO" mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  [ -f "$upstream" ] || { log "could not download k8s.io/kubernetes@$KUBERNETES_VERSION"; return 1; }
  {
    echo "module xmem.local/build/kubernetes"
    echo
    echo "go $(sed -n 's/^go \(.*\)$/\1/p' "$upstream")"
    echo
    echo "require k8s.io/kubernetes $KUBERNETES_VERSION"
    echo
    echo "replace ("
    # "k8s.io/api => ./staging/src/k8s.io/api" becomes "k8s.io/api => k8s.io/api v0.X.Y".
    sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/src/k8s\.io/.*$#\t\1 => \1 '"$staging_version"'#p' "$upstream"
    echo ")"
  } >"$mod/go.mod"
  cat >"$mod/tools.go" <<EOF
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
EOF
  (cd "$mod" && "$GO" mod tidy)
  local v="k8s.io/component-base/version"
  local ldflags="-s -w -X $v.gitVersion=$KUBERNETES_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$k8s_minor"
  ldflags+=" -X $v.gitTreeState=clean -X $v.buildDate=1970-01-01T00:00:00Z"
  mkdir -p "$WORK/out-kubernetes"
  (cd "$mod" && $NICE "$GO" build -trimpath -ldflags "$ldflags" -o "$WORK/out-kubernetes/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler)
  for b in "${bins[@]}"; do mv -f "$WORK/out-kubernetes/$b" "$DEST/bin/$b"; done
}

# --- etcd --------------------------------------------------------------------------------------
build_etcd() {
  wrap_build etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3 "-s -w"
}

# --- kwok, its Stages --------------------------------------------------------------------------
build_kwok() {
  wrap_build kwok sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok \
    "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
  local dir
  dir="$(module_dir sigs.k8s.io/kwok "$KWOK_VERSION")"
  cp "$dir"/kustomize/stage/node/fast/node-*.yaml "$DEST/kwok-stages/"
  cp "$dir"/kustomize/stage/node/heartbeat-with-lease/node-*.yaml "$DEST/kwok-stages/"
  cp "$dir"/kustomize/stage/pod/fast/pod-*.yaml "$DEST/kwok-stages/"
  chmod u+w "$DEST"/kwok-stages/*.yaml
}

# --- CRD manifests -----------------------------------------------------------------------------
copy_crds() {
  local dir
  dir="$(module_dir github.com/kubeflow/training-operator "$TRAINING_OPERATOR_VERSION")"
  cp "$dir/manifests/base/crds/kubeflow.org_pytorchjobs.yaml" "$DEST/crds/"
  dir="$(module_dir github.com/prometheus-operator/prometheus-operator "$PROMETHEUS_OPERATOR_VERSION")"
  cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml" "$DEST/crds/"
  cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml" "$DEST/crds/"
  dir="$(module_dir github.com/cert-manager/cert-manager "$CERT_MANAGER_VERSION")"
  cp "$dir"/deploy/crds/cert-manager.io_*.yaml "$DEST/crds/"
  chmod u+w "$DEST"/crds/*.yaml
}

build_etcd
build_kwok
copy_crds
build_kubernetes

# sed, not head: head would close the pipe early and pipefail would end the script.
"$DEST/bin/kube-apiserver" --version
"$DEST/bin/etcd" --version | sed -n 1p
"$DEST/bin/kwok" --version | sed -n 1p
cache_finish
