# Sourced by the image scripts: podman as this machine kind can run it.
#
# - runc, never crun: crun fails on hosts with cgroup v1 controllers ("cgroups in hybrid mode
#   not supported").
# - Lower open-file and process limits than podman's defaults, which fail here with
#   "setrlimit ... Operation not permitted" (the sandbox's own hard limits are lower).
# - The host's CA bundle and pip configuration are bind-mounted into build steps
#   (XMEM_BUILD_HOST_TRUST=0 turns that off): pip inside a build then trusts what pip on the
#   host trusts (a TLS-intercepting proxy's CA, as here) and uses the host's index settings. The
#   mounts are not part of any layer that reaches the runtime image.
PODMAN=(podman --runtime runc)
ULIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024)

TRUST_MOUNTS=()
if [ "${XMEM_BUILD_HOST_TRUST:-1}" = 1 ]; then
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    TRUST_MOUNTS+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
  fi
  if [ -f /etc/pip.conf ]; then
    TRUST_MOUNTS+=(-v /etc/pip.conf:/etc/pip.conf:ro)
  fi
fi

# The image's size as podman reports it (bytes), e.g. `image_bytes localhost/x:1`.
image_bytes() {
  "${PODMAN[@]}" image inspect --format '{{.Size}}' "$1"
}
