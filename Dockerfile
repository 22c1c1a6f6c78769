# syntax=docker/dockerfile:1
#
# arfuse image: the arfused sidecar and the arfusectl CLI.
#
#   docker build -t arfuse:$(git rev-parse --short HEAD) --build-arg GIT_REVISION=$(git rev-parse --short HEAD) .
#
# Two stages:
#   build    CUDA 13 devel on Ubuntu 24.04. Runs scripts/setup, the same script CI runs: it installs the
#            Debian/Ubuntu packages (gRPC 1.51, protobuf 3.21, abseil 20220623, spdlog, prometheus-cpp,
#            GoogleTest) and builds build/ with CMake + Ninja, CUDA parts on (nvcc and NCCL are in the image).
#   runtime  CUDA 13 runtime on Ubuntu 24.04 (libcudart, NCCL), plus only the shared libraries the two
#            binaries load, a non-root user (uid 10001) and a HEALTHCHECK through `arfusectl health`.
#
# No Docker engine runs on the project's machines: tests/deploy/test_dockerfile.py checks this file
# statically in CI (stages, scripts/setup, non-root USER, HEALTHCHECK, every arfused flag used).
#
# Runtime package names are Ubuntu 24.04's (noble), which carry the 64-bit time_t "t64" suffix where
# Debian 12 does not (libgrpc++1.51 -> libgrpc++1.51t64, libprotobuf32 -> libprotobuf32t64,
# libabsl20220623 -> libabsl20220623t64); spdlog is 1.12 there (libspdlog1.12, which pulls libfmt9),
# yaml-cpp 0.8 (libyaml-cpp0.8; Debian 12 has 0.7). gRPC's reflection library comes with libgrpc++.
# The last RUN of the runtime stage fails the build if `ldd` finds any library missing, so a new
# link dependency cannot slip through unnoticed.

ARG CUDA_VERSION=13.0.1
ARG UBUNTU_TAG=ubuntu24.04

# ---------------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU_TAG} AS build

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# scripts/setup also installs the Python client's test dependencies with pip; Ubuntu 24.04 marks its
# Python as externally managed (PEP 668), so allow pip inside this throw-away stage.
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src

# Packages first, in their own layer: it stays cached while only sources change.
COPY scripts/setup scripts/setup
RUN scripts/setup --no-build && rm -rf /var/lib/apt/lists/*

# Then the sources, and the same script builds build/ exactly as CI does. .git stays out of the
# context, so the revision comes in as a build argument (CMake can read ARFUSE_GIT_REVISION).
ARG GIT_REVISION=unknown
COPY . .
RUN ARFUSE_GIT_REVISION="${GIT_REVISION}" scripts/setup

# Stripped copies of the two binaries. `--version` touches no GPU, but the binary links the driver's
# libcuda.so.1, which only the host provides at run time: the toolkit's stub stands in for it here.
RUN install -d /out /tmp/cuda-stub \
 && install -m 0755 build/server/daemon/arfused build/tools/arfusectl/arfusectl /out/ \
 && strip --strip-unneeded /out/arfused /out/arfusectl \
 && ln -s /usr/local/cuda/lib64/stubs/libcuda.so /tmp/cuda-stub/libcuda.so.1 \
 && LD_LIBRARY_PATH=/tmp/cuda-stub /out/arfused --version \
 && LD_LIBRARY_PATH=/tmp/cuda-stub /out/arfusectl --version

# ---------------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU_TAG} AS runtime

ARG GIT_REVISION=unknown
LABEL org.opencontainers.image.title="arfuse" \
      org.opencontainers.image.description="arfused: per-GPU-rank sidecar for fused allreduce + residual add + RMSNorm" \
      org.opencontainers.image.revision="${GIT_REVISION}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Runtime libraries only (no -dev packages, no compilers). libcudart and libnccl2 come with the base
# image; libcuda.so.1 comes from the host driver through the NVIDIA container toolkit at run time.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51t64 \
      libgrpc29t64 \
      libprotobuf32t64 \
      libabsl20220623t64 \
      libspdlog1.12 \
      libfmt9 \
      libprometheus-cpp-core1.0 \
      libprometheus-cpp-pull1.0 \
      libyaml-cpp0.8 \
      libssl3t64 \
 && rm -rf /var/lib/apt/lists/*

# A fixed numeric uid/gid so Kubernetes can verify runAsNonRoot, and so the model server's container
# can run as the same uid (the main socket is 0660 and checked with SO_PEERCRED; MPS serves one uid).
RUN groupadd --system --gid 10001 arfuse \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin arfuse \
 && install -d -o 10001 -g 10001 -m 0750 /run/arfuse

COPY --from=build /out/arfused /out/arfusectl /usr/local/bin/

# Fail the build when a library the binaries load is missing. The driver's libcuda.so.1 is expected
# to be missing here: the NVIDIA container toolkit mounts it from the host when the container runs.
RUN missing="$(ldd /usr/local/bin/arfused /usr/local/bin/arfusectl | grep 'not found' \
      | grep -v -e 'libcuda\.so' -e 'libnvidia-' || true)" \
 && if [ -n "$missing" ]; then echo "runtime libraries missing:"; echo "$missing"; exit 1; fi

# Defaults every flag can also take from the environment (ARFUSE_<NAME>); the command line wins.
# 9310 = health (grpc.health.v1 only: "" liveness, "arfuse.v1.Fusion" readiness), 9330 = /metrics,
# 9350 = rank 0's peer rendezvous across nodes (--peer-addr). NVLink multicast stays off for NCCL.
ENV ARFUSE_HEALTH_PORT=9310 \
    ARFUSE_METRICS_PORT=9330 \
    NCCL_NVLS_ENABLE=0
EXPOSE 9310 9330 9350

USER 10001:10001

# Docker/Podman only (Kubernetes ignores it and uses the grpc probes in deploy/k8s). Checks liveness
# (service ""), which never depends on peers. arfusectl exits 1 when not serving and 3 when
# unreachable; HEALTHCHECK wants 0 or 1, hence `|| exit 1`.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD arfusectl health --addr "127.0.0.1:${ARFUSE_HEALTH_PORT}" --timeout-ms 3000 || exit 1

# arfused handles SIGTERM itself: readiness NOT_SERVING, in-flight calls get --grace-period, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/arfused"]
CMD ["--log-level=info"]
