#!/usr/bin/env bash
# Build a DRA kubelet plugin for the real node: sigs.k8s.io/dra-example-driver's
# cmd/dra-example-kubeletplugin, the Kubernetes project's example driver, which publishes
# simulated GPUs in a ResourceSlice for its node and prepares claims by writing CDI specs (env
# vars only). localkube/dra_plugin.py runs it beside the real node's kubelet as a host process;
# tests/realnode/test_a_dra_claim_runs_on_a_real_kubelet.py runs a claim through it.
#
#   bin/dra-example-kubeletplugin   from the Go module proxy
#
# Version: scripts/dra-driver-versions.env. Cache: $XMEM_DRA_DRIVER_CACHE (default
# ~/.cache/xmem-admission/dra-driver)/<version>_r<recipe>/; the temporary Go caches live in
# <cache>/.build-<key>/ while building and are deleted when it succeeds. .tools/dra-driver links
# to the cache entry. Not part of `make tools`: `make node-tools` builds it with the node.
#
# Measured here (2026-12-04, 2 cores, cold module cache, nice 19 while the CI's control plane
# build and another node build ran: load 11-15): 8.0 min wall, 3.6 min of CPU; a 52 MB binary;
# 0.02 s warm.
set -euo pipefail

# shellcheck source=go-cache.sh
source "$(dirname "$0")/go-cache.sh"
# shellcheck source=dra-driver-versions.env
source "$ROOT/scripts/dra-driver-versions.env"
cache_begin dra-driver \
  "${XMEM_DRA_DRIVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/xmem-admission/dra-driver}" \
  "${DRA_DRIVER_VERSION}_r${DRA_DRIVER_BUILD_RECIPE}"
mkdir -p "$DEST/bin"

# The module's go.mod replaces nothing, so a wrapper module requiring it builds it (its Makefile
# stamps main.version the same way).
wrap_build dra-example-kubeletplugin sigs.k8s.io/dra-example-driver "$DRA_DRIVER_VERSION" \
  sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin \
  "-s -w -X main.version=$DRA_DRIVER_VERSION"
"$DEST/bin/dra-example-kubeletplugin" --help >/dev/null

cache_finish
