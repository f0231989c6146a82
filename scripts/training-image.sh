#!/usr/bin/env bash
# A training image standing for a user's: one torch release from PyPI on Debian's Python.
#
#   scripts/training-image.sh TORCH_VERSION PYTHON_MINOR        e.g. 2.2.2 3.9
#
# prints the image's reference (localhost/xmem-train:torchVERSION-pyMINOR) on stdout; an image
# that exists already is reused. The interpreter is the Debian suite's own python3 (bullseye 3.9,
# bookworm 3.11, trixie 3.13), the base made by scripts/base-image.sh; torch and NumPy are
# installed by pip inside the build (scripts/training-image.Containerfile) with the host's pip
# cache mounted for reuse. Measured: the two builds left it at 2 MB (pip inside the build kept
# no torch wheel there, cause not found yet), so each build downloads its wheels from PyPI.
#
# Each image is a CUDA build of torch from PyPI with its nvidia-* wheels: several GB.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=image-common.sh
source "$ROOT/scripts/image-common.sh"

TORCH="${1:?usage: training-image.sh TORCH_VERSION PYTHON_MINOR}"
PYMINOR="${2:?usage: training-image.sh TORCH_VERSION PYTHON_MINOR}"
TAG="localhost/xmem-train:torch$TORCH-py$PYMINOR"
case "$PYMINOR" in
  3.9) SUITE=bullseye;;
  3.11) SUITE=bookworm;;
  3.13) SUITE=trixie;;
  *) echo "training-image: no Debian suite ships Python $PYMINOR (3.9, 3.11 and 3.13 do)" >&2
     exit 1;;
esac
# torch 2.2's wheels are built against NumPy 1.x (NumPy 2 support arrived in torch 2.3: its
# release notes).
NUMPY="numpy"
if [ "$(echo "$TORCH" | cut -d. -f1)" = 2 ] && [ "$(echo "$TORCH" | cut -d. -f2)" -lt 3 ]; then
  NUMPY="numpy<2"
fi

if "${PODMAN[@]}" image exists "$TAG"; then
  echo "$TAG"
  exit 0
fi
started=$(date +%s)
BASE="$(bash "$ROOT/scripts/base-image.sh" "$SUITE")"
PIP_CACHE="$(python3 -m pip cache dir 2>/dev/null || echo "$HOME/.cache/pip")"
mkdir -p "$PIP_CACHE"
base_ready=$(date +%s)
"${PODMAN[@]}" build --layers=false "${ULIMITS[@]}" "${TRUST_MOUNTS[@]}" \
  -v "$PIP_CACHE:/root/.cache/pip" \
  --build-arg "BASE_IMAGE=$BASE" --build-arg "TORCH_VERSION=$TORCH" --build-arg "NUMPY=$NUMPY" \
  -t "$TAG" -f "$ROOT/scripts/training-image.Containerfile" "$ROOT/scripts" >&2
done_at=$(date +%s)
echo "training-image: $TAG built in $((done_at - started)) s (base $((base_ready - started)) s," \
  "torch $((done_at - base_ready)) s); size $(("$(image_bytes "$TAG")" / 1000000)) MB" >&2
echo "$TAG"
