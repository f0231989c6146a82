#!/usr/bin/env bash
# Build the Kueue controller (sigs.k8s.io/kueue/cmd/kueue) once per pinned release, for the Kueue
# tests on the real control plane (localkube/kueue.py), into a cache outside the clone:
#
#   bin/kueue     the controller manager, from the Go module proxy
#   crds/*.yaml   its CRDs, copied from the module's config/components/crd/bases
#   webhooks.yaml its webhook configurations, config/components/webhook/manifests.yaml
#
# Version: scripts/kueue-versions.env. The control plane's own cache (scripts/build-kube.sh,
# keyed by every line of kube-versions.env) is not touched. Cache: $XMEM_KUEUE_CACHE (default
# ~/.cache/xmem-admission/kueue)/<version>_r<recipe>/; the temporary Go caches live in
# <cache>/.build-<key>/ while building (an interrupted build resumes) and are deleted when it
# succeeds. .tools/kueue links to the cache entry.
set -euo pipefail

# shellcheck source=go-cache.sh
source "$(dirname "$0")/go-cache.sh"
# shellcheck source=kueue-versions.env
source "$ROOT/scripts/kueue-versions.env"
cache_begin kueue "${XMEM_KUEUE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/xmem-admission/kueue}" \
  "${KUEUE_VERSION}_r${KUEUE_BUILD_RECIPE}"
mkdir -p "$DEST/bin" "$DEST/crds"

# Kueue's go.mod replaces no module with a folder, so a wrapper module requiring it builds it.
wrap_build kueue sigs.k8s.io/kueue "$KUEUE_VERSION" sigs.k8s.io/kueue/cmd/kueue \
  "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
dir="$(module_dir sigs.k8s.io/kueue "$KUEUE_VERSION")"
cp "$dir"/config/components/crd/bases/kueue.x-k8s.io_*.yaml "$DEST/crds/"
# Its webhook configurations (the tests point them at the host process: localkube/kueue.py).
cp "$dir"/config/components/webhook/manifests.yaml "$DEST/webhooks.yaml"
chmod u+w "$DEST"/crds/*.yaml "$DEST/webhooks.yaml"

cache_finish
