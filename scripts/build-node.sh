#!/usr/bin/env bash
# The real node's binaries (#29, item 3, in progress): the kubelet of the pinned Kubernetes
# release, from the same k8s.io/kubernetes module as the control plane (scripts/build-kube.sh),
# and containerd 2.x with its runc shim, from their Go modules, into
# ~/.cache/xmem-admission/node/<versions>/bin. runc and the CNI plugins come from Debian's
# packages (runc, containernetworking-plugins). Not yet part of `make tools` (`make node-tools`).
#
# Measured here (2 cores, cold module cache): 874 s for the three, 132 MB. By hand, kubelet
# v1.36.3 in standalone mode (failCgroupV1: false, cgroupDriver: cgroupfs, failSwapOn: false)
# reached containerd v2.4.2 over CRI ("Container runtime initialized ... version=v2.4.2") and
# answered /healthz; it made its root directory a bind mount and kubepods cgroups in every v1
# hierarchy, which a fixture must undo (umount, rmdir) when it stops it. No pod has run on it yet.
set -euo pipefail

source "$(dirname "$0")/go-cache.sh"
source "$ROOT/scripts/kube-versions.env"
source "$ROOT/scripts/node-versions.env"
cache_begin node "${XMEM_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/xmem-admission/node}" \
  "k8s-${KUBERNETES_VERSION}_containerd-${CONTAINERD_VERSION}_r${NODE_BUILD_RECIPE}"
mkdir -p "$DEST/bin"

build_kubelet() {
  [ -x "$DEST/bin/kubelet" ] && return 0
  local minor="${KUBERNETES_VERSION#v1.}" mod="$WORK/wrap-kubelet" upstream
  minor="${minor%%.*}"
  log "k8s.io/kubernetes $KUBERNETES_VERSION: kubelet"
  mkdir -p "$mod"
  upstream="$("$GO" mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  # k8s.io/kubernetes replaces its staging modules with local paths; a module that requires it
  # names their published versions (v0.MINOR.PATCH) instead.
  printf 'module xmem.local/build/kubelet\n\ngo %s\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n%s\n)\n' \
    "$(sed -n 's/^go \(.*\)$/\1/p' "$upstream")" "$KUBERNETES_VERSION" \
    "$(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/src/k8s\.io/.*$#\t\1 => \1 v0.'"$minor.${KUBERNETES_VERSION##*.}"'#p' "$upstream")" \
    >"$mod/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/kubelet"\n' >"$mod/tools.go"
  (cd "$mod" && "$GO" mod tidy)
  local v="k8s.io/component-base/version"
  (cd "$mod" && $NICE "$GO" build -trimpath -o "$WORK/kubelet" -ldflags \
    "-s -w -X $v.gitVersion=$KUBERNETES_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$minor" \
    k8s.io/kubernetes/cmd/kubelet)
  mv -f "$WORK/kubelet" "$DEST/bin/kubelet"
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

build_containerd
build_kubelet
"$DEST/bin/kubelet" --version >&2
"$DEST/bin/containerd" --version >&2
cache_finish
