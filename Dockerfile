# syntax=docker/dockerfile:1
# megamoe inference service.
#   build:   CUDA 12.8 devel image, builds the megamoe wheel for sm_90a (Hopper) and sm_100a (Blackwell)
#   runtime: CUDA 12.8 runtime image, torch for CUDA 12.8, the wheel, `megamoe serve` as a non-root user
# The steps are docker/build.sh; CI runs the same script in its CPU mode (docker/build.sh ci).
# Versions: constraints.txt (torch, the service extra, the build tools), the base images by tag.
# The GPU node needs an NVIDIA driver >= 570 (CUDA 12.8) and the NVIDIA Container Toolkit.
# Without a GPU: docker/Dockerfile.cpu (no CUDA images at all).
ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
ARG MEGAMOE_CUDA_ARCHS="90a;100a"
ARG BUILD_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDACXX=/usr/local/cuda/bin/nvcc \
    CMAKE_BUILD_PARALLEL_LEVEL=${BUILD_JOBS}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ git \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN MEGAMOE_BUILD_MODE=gpu MEGAMOE_CUDA_ARCHS="${MEGAMOE_CUDA_ARCHS}" bash docker/build.sh wheel /src /dist

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION="==2.13.0"
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY constraints.txt docker/build.sh docker/healthcheck.py docker/entrypoint.sh /opt/megamoe/docker/
COPY --from=build /dist /tmp/dist
RUN MEGAMOE_BUILD_MODE=gpu TORCH_INDEX_URL="${TORCH_INDEX_URL}" TORCH_VERSION="${TORCH_VERSION}" \
      bash /opt/megamoe/docker/build.sh install /tmp/dist /opt/venv \
 && rm -rf /tmp/dist \
 && useradd --system --create-home --uid 10001 --shell /usr/sbin/nologin megamoe \
 && mkdir -p /checkpoints \
 && chown megamoe /checkpoints
ENV PATH=/opt/venv/bin:${PATH} \
    MEGAMOE_HOST=0.0.0.0 \
    MEGAMOE_PORT=8000
USER 10001
WORKDIR /home/megamoe
EXPOSE 8000
# start-period covers loading the checkpoint and the start-up self-test
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["/opt/venv/bin/python", "/opt/megamoe/docker/healthcheck.py"]
STOPSIGNAL SIGTERM
# checks MEGAMOE_CHECKPOINT and a public address without MEGAMOE_TOKEN, then runs CMD
ENTRYPOINT ["/opt/megamoe/docker/entrypoint.sh"]
CMD ["megamoe", "serve"]
