#!/usr/bin/env bash
# `make image`: the project's Dockerfile built with podman.
#
#   XMEM_IMAGE       the tag (default localhost/xmem-admission:VERSION, VERSION from pyproject.toml)
#   XMEM_BASE_IMAGE  the base of both stages (the Dockerfile's BASE_IMAGE):
#                      unset     python:3.11-slim-bookworm from its registry when it can be
#                                pulled, else a Debian bookworm base made here
#                                (scripts/base-image.sh)
#                      local     the Debian base made here, without trying a registry
#                      REF       any image reference
#   XMEM_BUILD_CONTEXT  the build context (default: the repository; the image tests pass a
#                    copy of what the Dockerfile copies, taken at one instant)
#
# Prints the build's time and the image's size; the tag goes to stdout at the end.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=image-common.sh
source "$ROOT/scripts/image-common.sh"

VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n 1)"
IMAGE="${XMEM_IMAGE:-localhost/xmem-admission:$VERSION}"
REGISTRY_BASE="docker.io/library/python:3.11-slim-bookworm"

started=$(date +%s)
case "${XMEM_BASE_IMAGE:-}" in
  "")
    pull_log="$(mktemp)"
    if "${PODMAN[@]}" image exists "$REGISTRY_BASE" \
        || "${PODMAN[@]}" pull -q "$REGISTRY_BASE" >/dev/null 2>"$pull_log"; then
      BASE="$REGISTRY_BASE"
    else
      echo "image: $REGISTRY_BASE cannot be pulled ($(tail -n 1 "$pull_log"));" \
        "building on a Debian base made here" >&2
      BASE="$(bash "$ROOT/scripts/base-image.sh" bookworm)"
    fi
    rm -f "$pull_log";;
  local) BASE="$(bash "$ROOT/scripts/base-image.sh" bookworm)";;
  *) BASE="$XMEM_BASE_IMAGE";;
esac
echo "image: building $IMAGE on $BASE" >&2
base_ready=$(date +%s)

# No layer cache: every changed source reruns the pip install anyway, and cached layers would
# stay behind as untagged images of ~230 MB each; the image this build replaces is removed.
previous="$("${PODMAN[@]}" image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
"${PODMAN[@]}" build "${ULIMITS[@]}" "${TRUST_MOUNTS[@]}" --layers=false \
  --build-arg "BASE_IMAGE=$BASE" -t "$IMAGE" -f "$ROOT/Dockerfile" \
  "${XMEM_BUILD_CONTEXT:-$ROOT}" >&2

if [ -n "$previous" ] \
    && [ "$previous" != "$("${PODMAN[@]}" image inspect --format '{{.Id}}' "$IMAGE")" ]; then
  "${PODMAN[@]}" rmi "$previous" >/dev/null 2>&1 || true
fi
done_at=$(date +%s)
echo "image: $IMAGE built in $((done_at - started)) s (base $((base_ready - started)) s," \
  "build $((done_at - base_ready)) s); size $(("$(image_bytes "$IMAGE")" / 1000000)) MB" >&2
echo "$IMAGE"
