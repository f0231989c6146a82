#!/usr/bin/env bash
# Install what building and running container images needs on this machine kind (Debian
# bookworm, root, cgroup v1, no Docker engine, no reachable image registry), from Debian's
# packages:
#
#   podman      builds the project's Dockerfile (its buildah library) and runs containers
#   runc        the OCI runtime (crun, podman's other choice, refuses cgroup v1 "hybrid" hosts)
#   mmdebstrap  makes a Debian root file system from Debian's packages: the base image when no
#               registry can be pulled from (scripts/base-image.sh)
#   containernetworking-plugins
#               the CNI plugins (bridge, host-local, loopback, portmap in /usr/lib/cni) of the
#               real node's pod network (localkube/kubelet.py)
#   iptables    what those plugins and the kubelet program the host's firewall with
#
# Unlike scripts/install-tools.sh this fails (exit 1) when a tool cannot be installed: `make
# image` cannot do without them.
set -euo pipefail

PACKAGES=(podman runc mmdebstrap containernetworking-plugins iptables)
missing=()
for package in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$package")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-image-tools: ${missing[*]} missing; installing them needs apt-get as root" >&2
    exit 1
  fi
  echo "install-image-tools: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine has no package lists yet.
  apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${missing[@]}" >/dev/null
  }
fi
podman --version >&2
runc --version | head -n 1 >&2
