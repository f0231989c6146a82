#!/usr/bin/env bash
# Build JobSet's controller (sigs.k8s.io/jobset, its main package at the module root) and Kubeflow
# Trainer v2's controller manager (github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager)
# once per pinned pair of releases, for the training-stack tests on the real control plane
# (localkube/jobset.py, localkube/trainer.py), into one cache entry outside the clone:
#
#   bin/jobset, bin/trainer       the two controllers, from the Go module proxy
#   jobset/crds/*.yaml            JobSet's CRD (config/components/crd/bases)
#   jobset/webhooks.yaml          its webhook configurations (config/components/webhook/manifests.yaml)
#   jobset/patches/*.yaml         the release's kustomize patches to them (config/components/webhook/patches)
#   trainer/crds/*.yaml           Trainer's CRDs (manifests/base/crds)
#   trainer/webhooks.yaml         its webhook configurations (manifests/base/webhook/manifests.yaml)
#   trainer/patches/*.yaml        the release's kustomize patches to them (manifests/base/webhook/patch_*.yaml)
#   trainer/runtimes/*.yaml       the ClusterTrainingRuntimes Trainer ships (manifests/base/runtimes)
#
# Versions: scripts/trainer-versions.env. Both are built from ONE wrapper module that requires
# both releases, by ONE `go build`, so the packages they share (k8s.io/*, controller-runtime) are
# downloaded and compiled once: Trainer v2.3.0 requires JobSet v0.12.0 itself, so minimal version
# selection raises JobSet's own dependencies only by patch releases (k8s.io/* v0.36.0 -> v0.36.2,
# controller-runtime v0.24.0 -> v0.24.1): the build Trainer makes of JobSet's packages as a library.
# Cache: $XMEM_TRAINER_CACHE (default ~/.cache/xmem-admission/trainer)/<key>/; the temporary Go
# caches live in <cache>/.build-<key>/ while building and are deleted when it succeeds.
# .tools/trainer links to the cache entry.
set -euo pipefail

# shellcheck source=go-cache.sh
source "$(dirname "$0")/go-cache.sh"
# shellcheck source=trainer-versions.env
source "$ROOT/scripts/trainer-versions.env"
cache_begin trainer "${XMEM_TRAINER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/xmem-admission/trainer}" \
  "${JOBSET_VERSION}_${TRAINER_VERSION}_r${TRAINER_BUILD_RECIPE}"

JOBSET_PKG=sigs.k8s.io/jobset
TRAINER_PKG=github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager
if [ ! -x "$DEST/bin/jobset" ] || [ ! -x "$DEST/bin/trainer" ]; then
  log "$JOBSET_PKG $JOBSET_VERSION + github.com/kubeflow/trainer/v2 $TRAINER_VERSION"
  mod="$WORK/wrap"
  mkdir -p "$mod" "$DEST/bin" "$WORK/out"
  printf 'module xmem.local/build/trainer\n\ngo 1.26\n\nrequire (\n\tsigs.k8s.io/jobset %s\n\tgithub.com/kubeflow/trainer/v2 %s\n)\n' \
    "$JOBSET_VERSION" "$TRAINER_VERSION" >"$mod/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport (\n\t_ "%s"\n\t_ "%s"\n)\n' \
    "$JOBSET_PKG" "$TRAINER_PKG" >"$mod/tools.go"
  (cd "$mod" && "$GO" mod tidy)
  # The version each reports (JobSet's pkg/version, Trainer prints none of its own).
  (cd "$mod" && $NICE "$GO" build -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion=$JOBSET_VERSION" \
    -o "$WORK/out/" "$JOBSET_PKG" "$TRAINER_PKG")
  mv -f "$WORK/out/jobset" "$DEST/bin/jobset"
  mv -f "$WORK/out/trainer-controller-manager" "$DEST/bin/trainer"
fi

jobset="$(module_dir sigs.k8s.io/jobset "$JOBSET_VERSION")"
trainer="$(module_dir github.com/kubeflow/trainer/v2 "$TRAINER_VERSION")"
mkdir -p "$DEST/jobset/crds" "$DEST/jobset/patches" "$DEST/trainer/crds" "$DEST/trainer/patches" \
  "$DEST/trainer/runtimes"
cp "$jobset"/config/components/crd/bases/jobset.x-k8s.io_*.yaml "$DEST/jobset/crds/"
cp "$jobset"/config/components/webhook/manifests.yaml "$DEST/jobset/webhooks.yaml"
cp "$jobset"/config/components/webhook/patches/*.yaml "$DEST/jobset/patches/"
cp "$trainer"/manifests/base/crds/trainer.kubeflow.org_*.yaml "$DEST/trainer/crds/"
cp "$trainer"/manifests/base/webhook/manifests.yaml "$DEST/trainer/webhooks.yaml"
cp "$trainer"/manifests/base/webhook/patch_*.yaml "$DEST/trainer/patches/"
cp "$trainer"/manifests/base/runtimes/*.yaml "$DEST/trainer/runtimes/"
rm -f "$DEST/trainer/runtimes/kustomization.yaml"
chmod -R u+w "$DEST/jobset" "$DEST/trainer"

cache_finish
