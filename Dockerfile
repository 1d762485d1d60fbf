# syntax=docker/dockerfile:1
# The vgpu node agent image: vgpu-ctl and the shim, for a DaemonSet (deploy/daemonset.yaml)
# or `docker run` on a GPU node.  Both build steps are scripts that CI runs too
# (tests/deploy/test_image_steps.py), since the machines that test this have no Docker engine:
#   build stage:  tools/image/build-wheel.sh      (compiles the shim and simgpu into the wheel)
#   final stage:  tools/image/install-runtime.sh  (installs it; no compiler in this stage)
#
#   docker build -t vgpu:0.1.0 .          (or: make image)
#   docker run --rm vgpu:0.1.0 --version
#
# The shim is loaded into other images: it needs their glibc to be at least the build
# stage's floor (build-wheel.sh prints it; 2.34 on this Debian 12 base).  For images with
# an older glibc, build with an older PYTHON_IMAGE.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN /src/tools/image/build-wheel.sh /src /dist

FROM ${PYTHON_IMAGE} AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="vgpu" \
      org.opencontainers.image.description="vgpu node agent: vgpu-ctl and the LD_PRELOAD shim that gives containers fractional GPUs" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"
RUN --mount=type=bind,from=build,source=/dist,target=/tmp/dist \
    --mount=type=bind,source=tools/image,target=/tmp/image \
    PIP_NO_CACHE_DIR=1 /tmp/image/install-runtime.sh /tmp/dist /opt/venv
# A non-root default.  Creating slices under the host's /run/vgpu and installing the shim
# into a host directory need root on the node: override with `--user 0` (docker) or
# `runAsUser: 0` (Kubernetes), as deploy/daemonset.yaml does for exactly those containers.
RUN useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin vgpu
ENV PATH=/opt/venv/bin:$PATH \
    VGPU_DIR=/run/vgpu \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
ENTRYPOINT ["vgpu-ctl"]
CMD ["--help"]
