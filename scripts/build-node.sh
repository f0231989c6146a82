#!/usr/bin/env bash
# The real node's binaries: the kubelet of the pinned Kubernetes release, from the
# same k8s.io/kubernetes module as the control plane (scripts/build-kube.sh), containerd 2.x with
# its runc shim, and a local image registry (distribution v3), from their Go modules, into
# ~/.cache/xmem-admission/node/<versions>/bin. runc and the CNI plugins come from Debian's
# packages (runc, containernetworking-plugins: scripts/install-image-tools.sh). Not part of
# `make tools`: `make node-tools`, and `make node-test` runs the node's test with it
# (tests/realnode, the fixture localkube/kubelet.py).
#
# Measured here (2 cores, cold module cache, nice 19 beside a CI run): 871 s for the four, 156 MB
# (containerd and its shim 3 min, the registry 2 min, the kubelet 8 min); 874 s for the first
# three alone before. The node these make ran its first pods on 2026-12-03
# (tests/realnode/test_a_pod_runs_on_a_real_kubelet.py: versions and findings in its docstring).
set -euo pipefail

source "$(dirname "$0")/go-cache.sh"
source "$ROOT/scripts/kube-versions.env"
source "$ROOT/scripts/node-versions.env"
# build_k8s NAME: cmd/NAME of k8s.io/kubernetes (kubelet, kube-proxy) into $DEST/bin.
build_k8s() {
  local name="$1"
  [ -x "$DEST/bin/$name" ] && return 0
  local minor="${KUBERNETES_VERSION#v1.}" mod="$WORK/wrap-$name" upstream
  minor="${minor%%.*}"
  log "k8s.io/kubernetes $KUBERNETES_VERSION: $name"
  mkdir -p "$mod"
  upstream="$("$GO" mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  # k8s.io/kubernetes replaces its staging modules with local paths; a module that requires it
  # names their published versions (v0.MINOR.PATCH) instead.
  printf 'module xmem.local/build/%s\n\ngo %s\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n%s\n)\n' \
    "$name" "$(sed -n 's/^go \(.*\)$/\1/p' "$upstream")" "$KUBERNETES_VERSION" \
    "$(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/src/k8s\.io/.*$#\t\1 => \1 v0.'"$minor.${KUBERNETES_VERSION##*.}"'#p' "$upstream")" \
    >"$mod/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/%s"\n' "$name" >"$mod/tools.go"
  (cd "$mod" && "$GO" mod tidy)
  local v="k8s.io/component-base/version"
  (cd "$mod" && $NICE "$GO" build -trimpath -o "$WORK/$name" -ldflags \
    "-s -w -X $v.gitVersion=$KUBERNETES_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor" \
    "k8s.io/kubernetes/cmd/$name")
  mv -f "$WORK/$name" "$DEST/bin/$name"
}

build_containerd() {
  local flags="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
  # no_btrfs: the btrfs snapshotter needs cgo; overlayfs is the one used here.
  export GOFLAGS="-mod=mod -tags=no_btrfs"
  wrap_build containerd github.com/containerd/containerd/v2 "$CONTAINERD_VERSION" \
    github.com/containerd/containerd/v2/cmd/containerd "$flags"
  wrap_build containerd-shim-runc-v2 github.com/containerd/containerd/v2 "$CONTAINERD_VERSION" \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 "$flags"
  export GOFLAGS=-mod=mod
}

# The registry's own cmd/registry links every storage driver (S3, Azure, GCS and their SDKs); the
# node needs the file system driver and htpasswd authentication only, so a main of ours runs the
# same root command (registry.RootCmd: `registry serve CONFIG`, `registry --version`) with just
# those registered: fewer packages to compile on a 2-core machine.
build_registry() {
  [ -x "$DEST/bin/registry" ] && return 0
  local module=github.com/distribution/distribution/v3 mod="$WORK/wrap-registry"
  log "$module $DISTRIBUTION_VERSION: registry"
  mkdir -p "$mod"
  printf 'module xmem.local/build/registry\n\ngo 1.26\n\nrequire %s %s\n' \
    "$module" "$DISTRIBUTION_VERSION" >"$mod/go.mod"
  cat >"$mod/main.go" <<GO
package main

import (
	"os"

	"$module/registry"
	_ "$module/registry/auth/htpasswd"
	_ "$module/registry/storage/driver/filesystem"
)

func main() {
	if err := registry.RootCmd.Execute(); err != nil {
		os.Exit(1)
	}
}
GO
  (cd "$mod" && "$GO" mod tidy)
  (cd "$mod" && $NICE "$GO" build -trimpath -o "$WORK/registry" -ldflags \
    "-s -w -X $module/version.version=$DISTRIBUTION_VERSION" .)
  mv -f "$WORK/registry" "$DEST/bin/registry"
}

CACHE_ROOT="${XMEM_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/xmem-admission/node}"
# Each entry in a subshell: cache_begin exits at once when its entry is complete.
(
  cache_begin node "$CACHE_ROOT" \
    "k8s-${KUBERNETES_VERSION}_containerd-${CONTAINERD_VERSION}_registry-${DISTRIBUTION_VERSION}_r${NODE_BUILD_RECIPE}"
  mkdir -p "$DEST/bin"
  build_containerd
  build_registry
  build_k8s kubelet
  "$DEST/bin/kubelet" --version >&2
  "$DEST/bin/containerd" --version >&2
  "$DEST/bin/registry" --version >&2
  cache_finish
)
# kube-proxy (pods reach Services, the API server's among them), an entry of its own
# so that adding it did not rebuild the node's others.
(
  cache_begin node-proxy "$CACHE_ROOT" "k8s-${KUBERNETES_VERSION}_kube-proxy_r${PROXY_BUILD_RECIPE}"
  mkdir -p "$DEST/bin"
  build_k8s kube-proxy
  "$DEST/bin/kube-proxy" --version >&2
  cache_finish
)
