# syntax=docker/dockerfile:1
# xmem-admission: one image for the admission webhook (`xmem serve`), the controller
# (`xmem controller`), the chart's certificate hook (files/certgen.py) and the probe bundle the
# estimation pods' init container writes into an emptyDir. It never contains torch: the probe
# runs inside the user's own image, next to the user's torch.
#
# Build:   docker build -t xmem-admission:0.1.0 .
#          make image   (podman; on a Debian base of its own where no registry is reachable)
# See docs/install.md for pushing it and pointing the chart at it.

ARG PYTHON_VERSION=3.11
# Both stages' base: an image with `python` (PYTHON_VERSION) on PATH, its venv module, groupadd
# and useradd. scripts/base-image.sh makes one from Debian's packages (python3, python3-venv,
# python-is-python3) for builds that cannot pull from a registry.
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-bookworm

# --- build: a virtual environment with the package and its server dependencies -------------
FROM ${BASE_IMAGE} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md ./
COPY src ./src
# The `server` extra: FastAPI, uvicorn, pydantic, prometheus-client, kubernetes, PyYAML, orjson.
# cryptography is for the certificate hook (certgen.py), which runs this same image.
RUN /opt/venv/bin/pip install ".[server]" "cryptography>=42" \
    && /opt/venv/bin/python -m compileall -q /opt/venv/lib

# The probe bundle, built once here from the installed package: the build fails if a module the
# probe needs imports anything the user's image lacks (the bundle builder checks that wall).
# The estimation pod's init container runs the same `python -m xmem_admission.bundle DIR`.
RUN /opt/venv/bin/python -m xmem_admission.bundle /opt/xmem/probe \
    && /opt/venv/bin/python -m compileall -q /opt/xmem/probe

# --- runtime: the venv, the bundle, no compilers, no pip caches, not root ----------------
FROM ${BASE_IMAGE} AS runtime

LABEL org.opencontainers.image.title="xmem-admission" \
      org.opencontainers.image.description="GPU memory estimates for Kubernetes training jobs: admission webhook and controller" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed numeric user (the chart's runAsUser) so runAsNonRoot can verify it without /etc/passwd.
RUN groupadd --system --gid 65532 xmem \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin xmem

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/xmem/probe /opt/xmem/probe

# Read-only root filesystem: no .pyc written at run time (compiled above), temp files in /tmp
# (an emptyDir in the chart), unbuffered logs.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 65532:65532
WORKDIR /tmp
EXPOSE 8443 8080
ENTRYPOINT ["xmem"]
CMD ["serve"]
