# syntax=docker/dockerfile:1
# The pipefill proxy image.
#   docker build -t pipefill .
#   docker run --rm -p 8080:8080 -v "$PWD/my-proxy.toml:/etc/pipefill/proxy.toml:ro" pipefill
# (the example config/proxy.toml names backends on 127.0.0.1: with it, use --network host).
# Configuration: the TOML file at /etc/pipefill/proxy.toml (mount your own over the example) and
# PIPEFILL_* environment variables (nested with "__"), which take precedence over the file.
# See docs/deployment.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with the locked dependencies and the package ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/pipefill
WORKDIR /src
# Dependencies first, from hash-pinned locks, so source edits do not invalidate this layer.
COPY requirements.lock requirements-build.lock ./
RUN /opt/pipefill/bin/pip install --require-hashes --no-deps -r requirements.lock \
 && /opt/pipefill/bin/pip install --require-hashes --no-deps -r requirements-build.lock
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY loadtest ./loadtest
# The package itself: no dependency resolution (the lock is authoritative), no unpinned build env.
RUN /opt/pipefill/bin/pip install --no-deps --no-build-isolation . \
 && /opt/pipefill/bin/pip uninstall --yes setuptools \
 && /opt/pipefill/bin/pip check

# ---- runtime: the venv, the example configuration, a non-root user ----
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pipefill" \
      org.opencontainers.image.description="Reverse proxy for SGLang that keeps every backend's pipeline full" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 pipefill \
 && useradd --system --uid 10001 --gid pipefill --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin pipefill
COPY --from=build /opt/pipefill /opt/pipefill
COPY config/proxy.toml /etc/pipefill/proxy.toml
# Inside a container the proxy listens on all interfaces, port 8080, whatever the file says
# (environment beats file). Publish it with -p HOST_PORT:8080; if you change the port with
# -e PIPEFILL_SERVER__PORT=..., the HEALTHCHECK below follows it.
ENV PATH=/opt/pipefill/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIPEFILL_SERVER__HOST=0.0.0.0 \
    PIPEFILL_SERVER__PORT=8080
USER 10001:10001
EXPOSE 8080
# /health answers 200 while at least one backend is healthy. python is the one HTTP client the
# slim image has; urlopen raises (exit 1) on connection errors and non-2xx answers.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('PIPEFILL_SERVER__PORT', '8080') + '/health', timeout=2)"]
# SIGTERM drains streams in flight and exits within drain_s + shutdown_grace_s (give
# `docker stop -t` / stop_grace_period more than that sum: 40 s for the defaults, see
# docs/deployment.md); SIGHUP reloads the backend list. Exec form: the proxy is PID 1 and
# receives both signals itself.
STOPSIGNAL SIGTERM
ENTRYPOINT ["proxy"]
CMD ["--config", "/etc/pipefill/proxy.toml"]
