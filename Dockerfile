# syntax=docker/dockerfile:1
# The gateway's image: `phasegate serve`, as a non-root user, on a slim Python base.
#
#   docker build -t phasegate .
#   docker run -p 8000:8000 phasegate                  # the demo: embedded PostgreSQL, two sim workers
#   docker run -p 8000:8000 -e DATABASE_URL=postgresql://… -v ./phasegate.toml:/etc/phasegate/phasegate.toml:ro \
#       phasegate serve --host 0.0.0.0 --config /etc/phasegate/phasegate.toml
#
# The project is installed in editable mode from its own tree (kept in the image, read-only):
# the log's migrations live in migrations/ beside app/, not inside the package, and
# app/store/migrate.py finds them there. The GPU worker has its own image on top of
# vLLM's (deploy/worker/Dockerfile). tests/ops/test_images.py lints this file with hadolint
# and runs its install and start steps in a fresh venv (APP_HOME pointed at a temporary
# folder), so keep every path below under ${APP_HOME}.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG APP_HOME=/opt/phasegate
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR ${APP_HOME}/src
COPY pyproject.toml README.md alembic.ini ./
COPY statemachine/ statemachine/
COPY app/ app/
COPY migrations/ migrations/
# compiled here: the runtime's root filesystem may be read-only (deploy/kubernetes)
RUN python -m venv "${APP_HOME}/venv" \
    && "${APP_HOME}/venv/bin/pip" install --no-cache-dir -e . \
    && "${APP_HOME}/venv/bin/python" -m compileall -q app statemachine migrations

FROM ${PYTHON_IMAGE}
ARG APP_HOME=/opt/phasegate
# uid 10001: outside the range of the base image's users and of most hosts' accounts
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/phasegate --create-home phasegate
COPY --from=build ${APP_HOME} ${APP_HOME}
ENV PATH="${APP_HOME}/venv/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PHASEGATE_DATA_DIR=/var/lib/phasegate
WORKDIR /var/lib/phasegate
USER 10001:10001
EXPOSE 8000
# /healthz answers while the process serves; readiness (/readyz) is the orchestrator's business
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["phasegate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
