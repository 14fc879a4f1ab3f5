# kdelay service image: `docker build -t kdelay .` then `docker run kdelay --help`.
# BASE_IMAGE: any image with Python 3.11+, pip and useradd on PATH (tools/images
# builds one from Debian for machines without a registry).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY . .
RUN pip install . \
    && rm -rf /src \
    && useradd --system --uid 10001 --home-dir /state --no-create-home kdelay \
    && mkdir /state \
    && chown kdelay /state

USER kdelay
WORKDIR /state
ENV KDELAY_STATE_DIR=/state \
    KDELAY_METRICS_PORT=9464
VOLUME ["/state"]
EXPOSE 9464

# Healthy while the process runs and its metrics endpoint answers. It does not
# say the instance owns partitions or delivers on time: alert on the metrics.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/metrics' % os.environ['KDELAY_METRICS_PORT'], timeout=4).read(1)"]

# Exec form: kdelay is PID 1 and gets SIGTERM itself (it finishes its step and exits 0).
ENTRYPOINT ["kdelay"]
CMD ["run"]
