# kdelay service image: `docker build -t kdelay .` then `docker run kdelay --help`.
FROM python:3.11-slim

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
ENV KDELAY_STATE_DIR=/state
VOLUME ["/state"]

ENTRYPOINT ["kdelay"]
CMD ["run"]
