# One image for every ddiloco worker (learner, syncer, evaluator); see compose.yaml.
# BASE_IMAGE: any image with Python >= 3.10 and pip (e.g. one built locally from Debian
# packages where Docker Hub is out of reach): docker build --build-arg BASE_IMAGE=... .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu \
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
    DDILOCO_CACHE_DIR=/cache DDILOCO_JAX_CACHE=/cache/jax
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY store ./store
COPY workers ./workers
COPY chaos ./chaos
COPY ddiloco ./ddiloco
COPY configs ./configs
RUN pip install --no-cache-dir . && mkdir -p /cache /run/ddiloco
# Fetch the corpus at build time so workers start without network access.
RUN python -c "from workers.data import fetch_shakespeare; fetch_shakespeare()"
ENTRYPOINT ["ddiloco"]
