# syntax=docker/dockerfile:1
# longtake render worker: one per node, `longtake worker` (Celery, solo pool) driving the node's rank
# processes (docs/node.md). GPU build by default: torch 2.13.0's PyPI wheel, which is the CUDA 13.0
# build (+cu130) and brings its own CUDA libraries (cuda-toolkit 13.0.3, cuDNN, NCCL 2.29) — the
# host needs an NVIDIA driver >= 580 and the NVIDIA container toolkit. CPU build (compose default):
#   --build-arg BASE_IMAGE=ubuntu:24.04 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Measured here (issue 14): the Python environment of the GPU build installs to 5.0 GB (torch 1.2 GB,
# nvidia/* 2.7 GB, triton 0.7 GB); the image adds the CUDA runtime base on top.
# Build from the repository root: docker build -f docker/worker.Dockerfile -t longtake/worker .
ARG BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build
# checkov:skip=CKV_DOCKER_7: the base is the BASE_IMAGE build argument, a pinned nvidia/cuda tag by default
ARG TORCH_INDEX_URL=
COPY --from=ghcr.io/astral-sh/uv:0.9 /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1
# The project is tested on CPython 3.11 (Ubuntu 24.04 ships 3.12): a standalone 3.11 from uv.
RUN uv python install 3.11 && uv venv --python 3.11 /opt/venv
RUN uv pip install --python /opt/venv/bin/python --no-cache \
      ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md alembic.ini ./
COPY pipeline pipeline
COPY models models
COPY worker worker
COPY bench bench
COPY migrations migrations
RUN uv pip install --python /opt/venv/bin/python --no-cache .

FROM ${BASE_IMAGE}
# tini: PID 1 that forwards SIGTERM to Celery and reaps the rank processes; libnuma1: rank NUMA
# binding (pipeline/placement/numa.py; it falls back to the raw syscall without it).
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini libnuma1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 longtake \
 && useradd --uid 10001 --gid 10001 --home-dir /home/longtake --create-home --shell /usr/sbin/nologin longtake \
 && mkdir -p /var/lib/longtake/work /weights \
 && chown -R 10001:10001 /var/lib/longtake
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# `longtake migrate` uses the migrations installed with the package (worker.jobs.db.alembic_config).
# The demo inputs, for a smoke render in the pod
# (`longtake render --image models/checkpoints/demo_reference.png --audio assets/demo/speech.wav ...`).
COPY assets/demo assets/demo
COPY models/checkpoints/demo_reference.png models/checkpoints/demo_reference.png
COPY docker/healthcheck.py /usr/local/lib/longtake/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/longtake \
    XDG_CACHE_HOME=/tmp/cache \
    OMP_WAIT_POLICY=PASSIVE \
    LONGTAKE_LOG_JSON=true \
    LONGTAKE_WORK_DIR=/var/lib/longtake/work \
    LONGTAKE_METRICS_PORT=9400
USER 10001:10001
EXPOSE 9400
# Large checkpoints are mounted here (LONGTAKE_CHECKPOINT=/weights/...), never baked in; the tiny
# preset's checkpoint ships inside the installed `models` package.
VOLUME ["/weights"]
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
  CMD ["python", "/usr/local/lib/longtake/healthcheck.py", "worker"]
ENTRYPOINT ["tini", "--", "longtake"]
CMD ["worker"]
