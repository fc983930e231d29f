# syntax=docker/dockerfile:1
# longtake HTTP API (and `longtake migrate`): no torch, numpy, PyAV or Pillow. `import worker.api`,
# `longtake api` and `longtake migrate` never import them (tests/unit/test_deploy.py holds that), so
# the image installs docker/requirements-api.txt and then the project with --no-deps.
# Measured here (issue 14): that Python environment installs to 172 MB (vs 5.0 GB for the worker's).
# Build from the repository root: docker build -f docker/api.Dockerfile -t longtake/api .
FROM python:3.11-slim-bookworm AS build
RUN python -m venv /opt/venv
COPY docker/requirements-api.txt /tmp/requirements-api.txt
RUN /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements-api.txt
WORKDIR /src
COPY pyproject.toml README.md alembic.ini ./
COPY pipeline pipeline
COPY models models
COPY worker worker
COPY bench bench
COPY migrations migrations
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps .

FROM python:3.11-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 longtake \
 && useradd --uid 10001 --gid 10001 --home-dir /home/longtake --create-home --shell /usr/sbin/nologin longtake
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# `longtake migrate` uses the migrations installed with the package (worker.jobs.db.alembic_config).
COPY docker/healthcheck.py /usr/local/lib/longtake/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    LONGTAKE_LOG_JSON=true \
    LONGTAKE_API_HOST=0.0.0.0 \
    LONGTAKE_API_PORT=8000
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "/usr/local/lib/longtake/healthcheck.py", "api"]
ENTRYPOINT ["tini", "--", "longtake"]
CMD ["api"]
