#!/usr/bin/env bash
# A virtual environment standing for a user's image: one torch release from PyPI, one Python,
# numpy, Pillow (image pipelines import it, also where no torchvision installs), the matching
# torchvision, pytest (to run the probe's own tests with that torch), and, where they install
# against that torch, the conformance corpus's frameworks.
#
#   scripts/torch-venv.sh TORCH_VERSION PYTHON_MINOR      e.g. 2.2.2 3.9
#
# prints the environment's folder on stdout (everything else goes to stderr). The folder is
# $XMEM_TORCH_CACHE (default ~/.cache/xmem-admission/torch)/torch-VERSION-pyMINOR, outside the
# clone, so CI on the same machine and every clone reuse it; pip's own cache (~/.cache/pip) is
# shared by every build. A finished build has a .complete file; an interrupted one is started
# again. A second build of the same key waits for the first (flock).
#
# The interpreter comes from pyenv (`pyenv prefix MINOR`); Debian's python3 stands for 3.11
# where pyenv lacks it. A missing interpreter fails the build: it is never skipped.
#
# Each torch from PyPI is a CUDA build (it does not import without its nvidia-* wheels): about
# 4-5 GB installed, a few minutes to install from a warm pip cache.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TORCH="${1:?usage: torch-venv.sh TORCH_VERSION PYTHON_MINOR}"
PYMINOR="${2:?usage: torch-venv.sh TORCH_VERSION PYTHON_MINOR}"
CACHE="${XMEM_TORCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/xmem-admission/torch}"
DEST="$CACHE/torch-$TORCH-py$PYMINOR"
log() { echo "torch-venv $TORCH/py$PYMINOR: $*" >&2; }

# The fine-tuning stack (requirements/finetune.txt) goes into every environment of Python 3.10 or
# newer, also one built before the file changed: its stamp names the file's content.
FINETUNE="$ROOT/requirements/finetune.txt"
FINETUNE_STAMP="$DEST/.finetune-$(sha256sum "$FINETUNE" | cut -c1-12)"
finetune() {
  local minor_py="${PYMINOR#3.}"
  if [ "$minor_py" -lt 10 ] || [ -f "$FINETUNE_STAMP" ]; then return 0; fi
  log "installing the fine-tuning stack (requirements/finetune.txt)"
  local torch_pin="torch==$(cut -d+ -f1 "$DEST/torch-version.txt")"
  # DeepSpeed is an sdist whose build imports torch: built against this environment's torch
  # (no build isolation), with what it imports, as the Makefile builds it for .venv.
  if "$DEST/bin/python" -m pip --disable-pip-version-check install -qq -r "$FINETUNE" \
      "$torch_pin" setuptools wheel >&2 2>"$DEST/.pip-finetune.log" \
    && "$DEST/bin/python" -m pip --disable-pip-version-check install -qq --no-build-isolation \
      "$torch_pin" $(grep -E '^(deepspeed|einops|hjson|msgpack|ninja|py-cpuinfo)==' \
      "$ROOT/requirements/constraints.txt") >&2 2>>"$DEST/.pip-finetune.log"; then
    grep -qx finetune "$DEST/frameworks.txt" || echo finetune >>"$DEST/frameworks.txt"
    rm -f "$DEST"/.finetune-*
    touch "$FINETUNE_STAMP"
  else
    log "the fine-tuning stack does not install beside torch $TORCH (see $DEST/.pip-finetune.log)"
    return 1
  fi
}

if [ -f "$DEST/.complete" ] && { [ "${PYMINOR#3.}" -lt 10 ] || [ -f "$FINETUNE_STAMP" ]; }; then
  echo "$DEST"
  exit 0
fi

interpreter() {
  local prefix
  if prefix="$(pyenv prefix "$PYMINOR" 2>/dev/null)" && [ -x "$prefix/bin/python$PYMINOR" ]; then
    echo "$prefix/bin/python$PYMINOR"
  elif command -v "python$PYMINOR" >/dev/null && "python$PYMINOR" -c 'import venv' 2>/dev/null; then
    command -v "python$PYMINOR"
  else
    return 1
  fi
}
if ! PY="$(interpreter)"; then
  log "no Python $PYMINOR on this machine (looked for \`pyenv prefix $PYMINOR\` and python$PYMINOR)"
  exit 1
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock-torch-$TORCH-py$PYMINOR"
if ! flock -n 9; then
  log "another build is running; waiting for it"
  flock 9
fi
if [ -f "$DEST/.complete" ]; then
  finetune
  echo "$DEST"
  exit 0
fi

started=$(date +%s)
rm -rf "$DEST"
"$PY" -m venv "$DEST"
PIP=("$DEST/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -qq --upgrade pip >&2

minor="$(echo "$TORCH" | cut -d. -f2)"
# torchvision 0.(N+15) is built for torch 2.N (torchvision's README, "Installation": the
# compatibility table, 0.17 for 2.2 up to 0.30 for 2.15).
VISION="0.$((minor + 15)).*"
# torch 2.2's wheels are built against NumPy 1.x (NumPy 2 support arrived in torch 2.3: its
# release notes), so the older releases get a NumPy 1.
NUMPY="numpy"
if [ "$minor" -lt 3 ]; then NUMPY="numpy<2"; fi
log "installing torch==$TORCH with $("$PY" --version 2>&1)"
"${PIP[@]}" install -qq "torch==$TORCH" "$NUMPY" pillow "pytest>=8" "pytest-timeout>=2.3" >&2

# The matching torchvision, then the conformance corpus's frameworks at the development pins
# (requirements/constraints.txt), each only where it installs beside this torch without
# replacing it: a torchvision not released yet for the newest torch, or a framework that needs a
# newer torch, is left out, and the corpus's tests say which scripts that leaves untested.
FRAMEWORKS_FILE="$DEST/frameworks.txt"
: >"$FRAMEWORKS_FILE"
pin() {
  if [ "$1" = torchvision ]; then echo "torchvision==$VISION"; return; fi
  grep -E "^$1==" "$ROOT/requirements/constraints.txt" | head -1 || echo "$1"
}
for group in "torchvision" "timm" "transformers accelerate" "lightning pytorch-lightning torchmetrics lightning-utilities"; do
  specs=()
  for name in $group; do specs+=("$(pin "$name")"); done
  if "${PIP[@]}" install -qq "${specs[@]}" "torch==$TORCH" "$NUMPY" >&2 \
      2>"$DEST/.pip-${group%% *}.log"; then
    for name in $group; do echo "$name" >>"$FRAMEWORKS_FILE"; done
  else
    log "$group does not install beside torch $TORCH (see $DEST/.pip-${group%% *}.log)"
  fi
done
"$DEST/bin/python" -c "import torch; print(torch.__version__)" >"$DEST/torch-version.txt"
finetune
touch "$DEST/.complete"
log "ready in $(($(date +%s) - started)) s: torch $(cat "$DEST/torch-version.txt"), $(du -sh "$DEST" | cut -f1)"
echo "$DEST"
