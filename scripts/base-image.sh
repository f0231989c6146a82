#!/usr/bin/env bash
# A base image made from Debian's packages, for builds on machines that reach no image
# registry but do reach Debian's archive:
#
#   scripts/base-image.sh SUITE [PACKAGE...]        e.g. bookworm, bullseye, trixie
#
# prints the image's reference (localhost/xmem-debian:SUITE-HASH) on stdout. mmdebstrap
# (variant minbase: essential packages and apt, no init system) builds the root file system with
# python3, python3-venv, python-is-python3 and ca-certificates plus the PACKAGEs; `podman import`
# makes it a one-layer image with PATH and LANG set. An image that exists already is reused:
# the tag's HASH covers the suite and the package list.
#
# Debian's Python per suite: bullseye 3.9, bookworm 3.11, trixie 3.13.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=image-common.sh
source "$HERE/image-common.sh"

SUITE="${1:?usage: base-image.sh SUITE [PACKAGE...]}"
shift
PACKAGES=(python3 python3-venv python-is-python3 ca-certificates "$@")
HASH="$(printf '%s\n' "$SUITE" "${PACKAGES[@]}" | sha256sum | cut -c1-12)"
TAG="localhost/xmem-debian:$SUITE-$HASH"

if "${PODMAN[@]}" image exists "$TAG"; then
  echo "$TAG"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$(date +%s)
mmdebstrap --quiet --variant=minbase --include="$(IFS=,; echo "${PACKAGES[*]}")" \
  "$SUITE" "$work/root.tar" >&2
"${PODMAN[@]}" import \
  --change 'ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV=LANG=C.UTF-8' \
  --change 'CMD=["/bin/bash"]' \
  "$work/root.tar" "$TAG" >/dev/null
echo "base-image: $TAG from Debian $SUITE in $(($(date +%s) - started)) s," \
  "$(("$(image_bytes "$TAG")" / 1000000)) MB" >&2
echo "$TAG"
