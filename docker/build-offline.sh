#!/usr/bin/env bash
# Base images for the compose demo built from Debian packages alone, for sites that cannot reach
# Docker Hub (air-gapped clusters, registries behind a proxy). Needs root, debootstrap and a
# Docker engine; reaches only a Debian mirror (and PyPI later, when the ddiloco image is built).
#
#   docker/build-offline.sh            # builds the images below if they are missing
#   FORCE=1 docker/build-offline.sh    # rebuilds them
#
# Images (tags are overridable):
#   $BASE_TAG        ddiloco-base:bookworm        Debian minbase + python3 (venv on PATH), iproute2,
#                                                 iptables, nftables; BASE_IMAGE of the Dockerfile
#   $REDIS_TAG       ddiloco-redis:bookworm       + redis-server (REDIS_IMAGE in compose)
#   $PROMETHEUS_TAG  ddiloco-prometheus:bookworm  + Debian's prometheus (PROMETHEUS_IMAGE)
# Grafana is not packaged by Debian: the `grafana` compose profile needs GRAFANA_IMAGE from a
# registry you can reach (docs/COMPOSE.md).
#
# Environment: SUITE (bookworm), MIRROR (http://deb.debian.org/debian), WORKDIR (a scratch
# folder, removed at the end), FORCE=1 to rebuild.
set -euo pipefail

SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
BASE_TAG=${BASE_TAG:-ddiloco-base:$SUITE}
REDIS_TAG=${REDIS_TAG:-ddiloco-redis:$SUITE}
PROMETHEUS_TAG=${PROMETHEUS_TAG:-ddiloco-prometheus:$SUITE}
FORCE=${FORCE:-0}

log() { printf '[build-offline %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
have() { [ "$FORCE" != 1 ] && docker image inspect "$1" >/dev/null 2>&1; }

[ "$(id -u)" = 0 ] || { echo "build-offline.sh: needs root (debootstrap)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "build-offline.sh: install debootstrap" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "build-offline.sh: no Docker engine answers" >&2; exit 1; }

start=$SECONDS
if have "$BASE_TAG"; then
  log "$BASE_TAG exists (FORCE=1 rebuilds it)"
else
  WORKDIR=${WORKDIR:-$(mktemp -d /var/tmp/ddiloco-rootfs.XXXXXX)}
  trap 'rm -rf "$WORKDIR"' EXIT
  rootfs=$WORKDIR/rootfs
  log "debootstrap $SUITE (minbase) into $rootfs from $MIRROR"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,ca-certificates,iproute2,iptables,nftables,procps \
    "$SUITE" "$rootfs" "$MIRROR" >"$WORKDIR/debootstrap.log" 2>&1 \
    || { tail -20 "$WORKDIR/debootstrap.log" >&2; exit 1; }
  # A venv on PATH: pip installs into it (Debian's python3 refuses system-wide installs).
  chroot "$rootfs" python3 -m venv /opt/venv
  chroot "$rootfs" /opt/venv/bin/python -m pip --version >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  log "docker import -> $BASE_TAG"
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$BASE_TAG" >/dev/null
  rm -rf "$WORKDIR"
  trap - EXIT
fi

# The two service images are apt installs on top of the base (one layer each).
build_on_base() {  # TAG PACKAGES ENTRYPOINT-JSON CMD-JSON
  local tag=$1 packages=$2 entrypoint=$3 cmd=$4
  if have "$tag"; then log "$tag exists"; return; fi
  log "building $tag (apt: $packages)"
  docker build -q -t "$tag" --build-arg BASE="$BASE_TAG" - >/dev/null <<DOCKERFILE
ARG BASE
FROM \${BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/*
ENTRYPOINT $entrypoint
CMD $cmd
DOCKERFILE
}
# Entrypoints as in the public images: redis's runs the command, prometheus's is the binary.
build_on_base "$REDIS_TAG" "redis-server redis-tools" '[]' '["redis-server"]'
build_on_base "$PROMETHEUS_TAG" "prometheus" '["prometheus"]' \
  '["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'

log "done in $((SECONDS - start)) s: $BASE_TAG $REDIS_TAG $PROMETHEUS_TAG"
cat <<ENV
# For compose (or put these in .env):
export BASE_IMAGE=$BASE_TAG REDIS_IMAGE=$REDIS_TAG PROMETHEUS_IMAGE=$PROMETHEUS_TAG
ENV
