# kdelay service image: `docker build -t kdelay .` then `docker run kdelay --help`.
# BASE_IMAGE: any Debian-based image with Python 3.11+, pip, apt-get and useradd on
# PATH (tools/images builds one from Debian for machines without a registry).
ARG BASE_IMAGE=python:3.11-slim

# Build stage: a C compiler and Python's headers, so that setup.py compiles the
# delivery hot path with mypyc into kdelay's wheel. Only the wheel leaves it.
FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN include=$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])') \
    && packages="gcc libc6-dev" \
    && if [ ! -e "$include/Python.h" ]; then packages="$packages python3-dev"; fi \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels .

# The service image: the wheel, no compiler. The build fails unless the hot
# path it installed runs compiled.
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY --from=build /wheels /wheels
RUN pip install /wheels/kdelay-*.whl \
    && rm -rf /wheels \
    && python -c 'import sys; from kdelay import native; sys.exit(native.mode != "compiled" and f"hot path {native.mode}")' \
    && useradd --system --uid 10001 --home-dir /state --no-create-home kdelay \
    && mkdir /state \
    && chown kdelay /state

USER kdelay
WORKDIR /state
ENV KDELAY_STATE_DIR=/state \
    KDELAY_METRICS_PORT=9464
VOLUME ["/state"]
EXPOSE 9464

# Healthy while the service loop lives (/healthz: it steps, restores a partition
# or waits out a Kafka outage). Whether it serves is /readyz (compose.yml's check).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['KDELAY_METRICS_PORT'], timeout=4).read(1)"]

# Exec form: kdelay is PID 1 and gets SIGTERM itself (it finishes its step and exits 0).
ENTRYPOINT ["kdelay"]
CMD ["run"]
