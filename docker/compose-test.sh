#!/usr/bin/env bash
# The compose demo, end to end, on a real Docker engine (`make compose-test`; root).
#
#   bash docker/compose-test.sh       # the demo (steps 1-8 below)
#   bash docker/compose-test.sh ha    # the profile `ha`: a Redis failover (`make compose-test-ha`)
#
#  1. installs what is missing: Debian's docker.io engine and debootstrap, and the Compose v2
#     and buildx plugins (Debian trixie's packages where the release has none); starts dockerd
#     when no engine answers (there may be no systemd);
#  2. records the host's iptables rules, bridges, sysctls and modules;
#  3. builds the base images from Debian packages (docker/build-offline.sh) and the ddiloco
#     image once (`docker compose build`), timing both;
#  4. `docker compose up -d` a short run (DDILOCO_STEPS, 240 by default) on its own subnets and
#     project name; waits for the first merge through `ddiloco status --json` and reports the
#     time from `up`; checks the blobs live in the `blobs` S3 service (docker/check-blobs.py:
#     the run's location is its s3:// URL, Redis holds pointers, the objects are there);
#     kills the object store `blobs` (SIGKILL), starts it again 5 s later and checks publishes
#     resume and every head still points at an object that is there;
#  5. kills one learner container (SIGKILL), starts it again and checks it rejoins: a new
#     incarnation, training again, and merges after its restart; checks the blobs again;
#  6. checks every query of the Grafana dashboard returns data from the deployment's Prometheus
#     (profile `metrics`);
#  7. waits for the `finish` service: exit 0, report.json with every learner's tokens; every
#     other service (the object store `blobs` too) exits 0 on its own;
#  8. `down -v`; when this script started the engine it stops it and restores the rules,
#     bridges, sysctls and modules it found, then checks they are as before.
#
# Mode `ha` runs the demo with the profile `ha` (docker/ha.env: a primary, two replicas, three
# sentinels; every worker on the sentinel URL) as project ddiloco-ha, 160 steps by default,
# without Prometheus, and replaces steps 4b-6 with a failover: it checks the sentinels name `redis` with both replicas
# attached, kills the primary's container (SIGKILL), times the sentinels' switch to a replica,
# waits until the fragments' versions move on, reads from the run's merge events the time from
# the kill to the next merge (docker/check-failover.py: no version merged twice or skipped),
# checks the blobs, starts the old primary again and waits until it is a replica of the new
# one. In step 7 the nodes, the sentinels and `redis-ha-stop` must exit 0 on their own too.
#
# Prints a JSON line of timings at the end; exits non-zero on the first failed check, and then
# prints the failing step, `docker compose ps` and the last 50 lines of every container that
# exited non-zero or never became healthy. A container that crashes fails the test at once,
# not at the end of a wait. The host is restored on every exit path: failure, Ctrl-C, SIGTERM
# (a CI time-out). Off-root it says so and exits 2.
# Environment: DDILOCO_STEPS, DDILOCO_NET (172.29), PROJECT (ddiloco-smoke), PROMETHEUS_PORT
# (9090, the host port Prometheus publishes), KEEP_ENGINE=1 to leave an engine this script
# started running, EXTRA_CA_BUNDLE (default: $PIP_CERT if set), FRESH=1 to rebuild every image
# from scratch (no cache) for honest build times. Images stay cached in the engine between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODE=${1:-default}
case "$MODE" in
  default) PROJECT=${PROJECT:-ddiloco-smoke}; PROFILES=(--profile metrics) ;;
  ha)
    PROJECT=${PROJECT:-ddiloco-ha}; PROFILES=(--profile ha); DDILOCO_STEPS=${DDILOCO_STEPS:-160}
    # the profile, the workers' sentinel URL and the primary's write guard, as a user gets them
    set -a; . docker/ha.env; set +a ;;
  *) echo "usage: $0 [ha]" >&2; exit 2 ;;
esac
export DDILOCO_STEPS=${DDILOCO_STEPS:-240}
export DDILOCO_NET=${DDILOCO_NET:-172.29}
export PROMETHEUS_PORT=${PROMETHEUS_PORT:-9090}
export DDILOCO_OUT=${DDILOCO_OUT:-$REPO/out/compose-test}
export BASE_IMAGE=${BASE_IMAGE:-ddiloco-base:bookworm}
export REDIS_IMAGE=${REDIS_IMAGE:-ddiloco-redis:bookworm}
export PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-ddiloco-prometheus:bookworm}
if [ -z "${EXTRA_CA_BUNDLE:-}" ] && [ -n "${PIP_CERT:-}" ] && [ -s "$PIP_CERT" ]; then
  export EXTRA_CA_BUNDLE=$PIP_CERT
fi
STATE=$(mktemp -d /tmp/ddiloco-compose-test.XXXXXX)
LEARNER=learner-1
t_start=$SECONDS

STEP="checks"
log() { printf '[compose-test %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
fail() { log "FAIL in step '$STEP': $*"; exit 1; }
step() { STEP=$*; log "== $STEP"; }
if [ "$(id -u)" != 0 ]; then
  echo "compose-test: needs root (it installs and starts a Docker engine, runs debootstrap and" \
       "changes the host's nftables rules, bridges and sysctls, which it restores); run it as" \
       "root: sudo make compose-test (CI runs it as root after the suite)" >&2
  rm -rf "$STATE"
  exit 2
fi

# -- 1. what it needs -------------------------------------------------------------------------
step "install the engine and plugins"
apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >"$STATE/apt.log" 2>&1 \
                  || { tail -20 "$STATE/apt.log" >&2
                       fail "no Docker engine here and 'apt-get install $*' failed (above):" \
                            "install Docker (docker.io, Compose v2, buildx) by hand and run again"; }; }
command -v apt-get >/dev/null || command -v dockerd >/dev/null \
  || fail "no Docker engine (dockerd) and no apt-get to install one: install Docker first"
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -q >/dev/null 2>&1 || true
  apt_install "${need[@]}"
fi
trixie_plugin() {  # PACKAGE: Debian trixie's build, where this release's is missing or too old
  local dir=$STATE/trixie
  mkdir -p "$dir/lists/partial"
  echo "deb http://deb.debian.org/debian trixie main" >"$dir/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$dir/lists")
  apt-get "${opts[@]}" update -q >/dev/null 2>&1 || fail "apt-get update (trixie)"
  (cd "$dir" && apt-get "${opts[@]}" download "$1" >/dev/null 2>&1) || fail "download $1"
  dpkg -i "$dir"/"$1"_*.deb >/dev/null || fail "dpkg -i $1"
}
docker compose version >/dev/null 2>&1 || { log "installing the Compose v2 plugin"; trixie_plugin docker-compose; }
docker buildx version >/dev/null 2>&1 || { log "installing the buildx plugin"; trixie_plugin docker-buildx; }

# -- 2. the host before the engine --------------------------------------------------------------
SYSCTLS=(net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables)
snapshot() {  # DIR
  mkdir -p "$1"
  # iptables and nftables rules both live in nftables here (iptables-nft): one ruleset.
  nft list ruleset >"$1/ruleset.nft" 2>/dev/null || true
  # Counters move; and a rule iptables-nft wrote prints its `ct state` set in the order it was
  # written, while the same rule restored by `nft -f` prints nft's order: compare sets, not order.
  python3 - "$1/ruleset.nft" >"$1/rules" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
text = re.sub(r"counter packets [0-9]+ bytes [0-9]+", "counter", text)
text = re.sub(r"(ct state )([a-z,]+)", lambda m: m[1] + ",".join(sorted(m[2].split(","))), text)
sys.stdout.write(text)
PY
  ip -o link show type bridge | awk -F': ' '{print $2}' | sort >"$1/bridges"
  ip -o link show type veth | awk -F': ' '{print $2}' | cut -d@ -f1 | sort >"$1/veths"
  for s in "${SYSCTLS[@]}"; do echo "$s=$(sysctl -n "$s" 2>/dev/null || echo absent)"; done >"$1/sysctls"
  { [ -r /proc/modules ] && awk '{print $1}' /proc/modules | sort; } >"$1/modules" 2>/dev/null || true
}
started_engine=0
step "start the engine"
if ! docker info >/dev/null 2>&1; then
  snapshot "$STATE/before"
  log "starting dockerd"
  dockerd >"$STATE/dockerd.log" 2>&1 &
  echo $! >"$STATE/dockerd.pid"
  started_engine=1
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$STATE/dockerd.log" >&2; fail "dockerd did not answer"; }
fi

# Containers of the project that crashed: "name exit-code" for each one that exited non-zero.
crashed() {
  local id
  for id in $(compose ps -a -q 2>/dev/null); do
    docker inspect -f '{{.Name}} {{.State.Status}} {{.State.ExitCode}}' "$id" 2>/dev/null
  done | awk '$2 == "exited" && $3 != 0 {sub("^/", "", $1); print $1, $3}' | grep -v "^$SKIP_CRASH " || true
}
SKIP_CRASH=none  # a container killed on purpose (steps 4b, 5) until it is started again
fail_if_crashed() {
  local c
  c=$(crashed)
  [ -z "$c" ] || fail "container(s) exited non-zero: $(echo "$c" | tr '\n' ';')"
}
# What a person needs to see when the test fails: the step, `compose ps`, and the last 50
# lines of each container that exited non-zero or never became healthy.
report_failure() {
  log "compose-test failed in step '$STEP'"
  echo "---- docker compose ps -a" >&2
  compose "${PROFILES[@]}" ps -a >&2 2>/dev/null || true
  local id name status code health
  for id in $(compose "${PROFILES[@]}" ps -a -q 2>/dev/null); do
    read -r name status code health < <(docker inspect -f \
      '{{.Name}} {{.State.Status}} {{.State.ExitCode}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' \
      "$id" 2>/dev/null) || continue
    name=${name#/}
    if { [ "$status" = exited ] && [ "$code" != 0 ]; } || [ "$status" = created ] \
       || [ "$status" = restarting ] || [ "$health" = unhealthy ] || [ "$health" = starting ]; then
      if [ "$status" = created ]; then
        echo "---- $name: never started (exit $code)" >&2
      else
        echo "---- $name: $status (exit $code, health $health), last 50 lines" >&2
      fi
      docker logs --tail 50 "$id" >&2 2>&1 || true
    fi
  done
  if [ "$MODE" = ha ]; then  # the sentinels' view of the failover
    echo "---- sentinel-1, last 30 lines" >&2
    compose logs --no-log-prefix sentinel-1 2>&1 | grep -v waitpid | tail -30 >&2 || true
  fi
}
compose() { docker compose -p "$PROJECT" "$@"; }
status_json() { compose exec -T finish ddiloco status --json 2>/dev/null; }
jq_py() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

restore_host() {
  [ "$started_engine" = 1 ] || return 0
  [ "${KEEP_ENGINE:-0}" = 1 ] && { log "KEEP_ENGINE=1: the engine stays up"; return 0; }
  log "stopping dockerd and restoring the host"
  kill "$(cat "$STATE/dockerd.pid")" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null || break; sleep 1; done
  pkill -x containerd 2>/dev/null || true
  nft flush ruleset && nft -f "$STATE/before/ruleset.nft" || log "could not restore the ruleset"
  for br in $(ip -o link show type bridge | awk -F': ' '{print $2}'); do
    grep -qx "$br" "$STATE/before/bridges" || ip link del "$br" 2>/dev/null || true
  done
  while IFS='=' read -r key value; do
    [ "$value" = absent ] || sysctl -q -w "$key=$value" >/dev/null 2>&1 || true
  done <"$STATE/before/sysctls"
  if [ -r /proc/modules ]; then  # modules the engine loaded (br_netfilter, overlay, ...)
    for mod in br_netfilter overlay xt_MASQUERADE xt_addrtype; do
      grep -qx "$mod" "$STATE/before/modules" || rmmod "$mod" 2>/dev/null || true
    done
  fi
  snapshot "$STATE/after"
  local diffs=0
  for f in rules bridges veths sysctls; do
    if ! diff -u "$STATE/before/$f" "$STATE/after/$f" >"$STATE/$f.diff"; then
      log "host differs after cleanup: $f"; cat "$STATE/$f.diff" >&2; diffs=1
    fi
  done
  [ "$diffs" = 0 ] && log "host restored: nftables/iptables rules, bridges, veths, sysctls as before"
  return "$diffs"
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$rc" != 0 ] && command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    report_failure
  fi
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    compose "${PROFILES[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  restore_host || rc=1
  rm -rf "$STATE"
  exit "$rc"
}
trap cleanup EXIT
# Ctrl-C and a CI time-out (SIGTERM) end through cleanup too.
trap 'log "interrupted (SIGINT)"; exit 130' INT
trap 'log "terminated (SIGTERM)"; exit 143' TERM

# -- leftovers and ports ------------------------------------------------------------------------
step "check for leftovers and ports"
# A leftover of an earlier run of this project (killed before its cleanup) is removed; a network
# of anything else on the demo's subnets, or a taken port, is a clear error.
compose "${PROFILES[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
for net in $(docker network ls -q); do
  read -r nname subnets < <(docker network inspect -f \
    '{{.Name}} {{range .IPAM.Config}}{{.Subnet}},{{end}}' "$net" 2>/dev/null) || continue
  case ",$subnets" in
    *",$DDILOCO_NET."*)
      fail "docker network '$nname' ($subnets) already uses the demo's subnets $DDILOCO_NET.0.0/16:" \
           "remove it (docker network rm $nname) or pick others (DDILOCO_NET=172.30)";;
  esac
done
if [ "$MODE" = default ] && command -v ss >/dev/null && ss -Hltn "sport = :$PROMETHEUS_PORT" | grep -q .; then
  fail "host port $PROMETHEUS_PORT (Prometheus) is taken by: $(ss -Hltnp "sport = :$PROMETHEUS_PORT" \
        | awk '{print $NF}' | head -1); free it or set PROMETHEUS_PORT=19090"
fi

# -- 3. images --------------------------------------------------------------------------------
step "build the images"
t0=$SECONDS
no_cache=()
if [ "${FRESH:-0}" = 1 ]; then export FORCE=1; no_cache=(--no-cache); fi
bash docker/build-offline.sh
base_s=$((SECONDS - t0))
t0=$SECONDS
compose build "${no_cache[@]}" >"$STATE/build.log" 2>&1 \
  || { tail -30 "$STATE/build.log" >&2; fail "compose build"; }
build_s=$((SECONDS - t0))
log "images: base ${base_s} s, ddiloco ${build_s} s"

# -- 4. up, first merge ---------------------------------------------------------------------------
step "up and first merge"
rm -rf "$DDILOCO_OUT"
t_up=$SECONDS
compose "${PROFILES[@]}" up -d >"$STATE/up.log" 2>&1 || { cat "$STATE/up.log" >&2; fail "compose up"; }
first_merge_s=
for _ in $(seq 300); do
  merges=$(status_json | jq_py 'd.get("merges", 0)' 2>/dev/null || echo 0)
  if [ "${merges:-0}" -gt 0 ]; then first_merge_s=$((SECONDS - t_up)); break; fi
  fail_if_crashed
  sleep 1
done
[ -n "$first_merge_s" ] || fail "no merge within 300 s of up"
log "first merge ${first_merge_s} s after up"

# The blobs are objects in the `blobs` service; Redis keeps pointers (credentials sourced in
# the container, never printed).
BLOBS_URL=${DDILOCO_BLOBS:-s3://ddiloco/compose}
check_blobs() {
  compose exec -T finish sh -c 'set -a && . /blobs-secrets/s3.env && set +a && exec python - "$0"' \
    "$BLOBS_URL" <docker/check-blobs.py
}
step "blobs in the object store"
blobs_json=$(check_blobs) || fail "blobs are not in the object store $BLOBS_URL"
log "blobs: $blobs_json"

versions_now() {  # 0 while the store does not answer
  local v
  v=$(status_json | jq_py "sum(v or 0 for v in d['versions'])" 2>/dev/null) || v=0
  echo "${v:-0}"
}
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

if [ "$MODE" = ha ]; then
# -- H1. the profile ha: who is primary, replicas attached, workers on the sentinel URL ----------
step "the sentinels, the replicas and the workers' URL"
sentinel_cli() { compose exec -T "$1" redis-cli -p 26379 "${@:2}" 2>/dev/null; }
primary_of() {  # the primary's name as sentinel $1 announces it (empty when it does not answer)
  sentinel_cli "$1" sentinel get-master-addr-by-name ddiloco | head -1 | tr -d '\r'
}
node_info() { compose exec -T "$1" redis-cli info replication 2>/dev/null | tr -d '\r'; }
url=$(compose exec -T finish printenv DDILOCO_REDIS_URL | tr -d '\r')
case "$url" in redis+sentinel://*) ;; *) fail "finish's DDILOCO_REDIS_URL is $url, not a sentinel URL";; esac
for s in sentinel-1 sentinel-2 sentinel-3; do
  [ "$(primary_of "$s")" = redis ] || fail "$s names '$(primary_of "$s")' as primary, not redis"
done
sentinel_cli sentinel-1 sentinel ckquorum ddiloco | grep -q '^OK 3 ' \
  || fail "no quorum of 3 sentinels: $(sentinel_cli sentinel-1 sentinel ckquorum ddiloco)"
info=$(node_info redis)
echo "$info" | grep -q '^connected_slaves:2$' || fail "redis has not 2 replicas: $info"
echo "$info" | grep -q '^min_slaves_good_slaves:2$' \
  || fail "redis's write guard does not count 2 replicas (DDILOCO_REDIS_MIN_REPLICAS): $info"
log "workers on $url; the 3 sentinels name redis primary, 2 replicas attached"

# -- H2. kill the primary's container: a sentinel promotes a replica, training goes on ----------
step "kill the primary and check training goes on"
old=$(primary_of sentinel-1)
# a client of the store writes every 50 ms through the sentinel URL, each write acknowledged
# once a replica has it: the longest gap is the time the store took no replicated write. It
# runs in redis-ha-stop (a ddiloco container on the hub network that outlives any failover;
# finish may be restarted by one)
# finish may be restarted by one). A second one in the evaluator, whose engine DNS forgets the
# dead primary's name at once where the hosts file of redis-ha-stop (and of the learners) keeps
# its address, for which the kernel gives up a connect only after some seconds.
compose exec -T redis-ha-stop python - probe 180 <docker/check-failover.py >"$STATE/probe.out" \
  2>"$STATE/probe.err" &
probe_pid=$!
compose exec -T evaluator python - probe 180 <docker/check-failover.py >"$STATE/probe2.out" \
  2>"$STATE/probe2.err" &
probe2_pid=$!
for _ in $(seq 120); do
  grep -q '^probing' "$STATE/probe.out" && grep -q '^probing' "$STATE/probe2.out" && break
  sleep 0.5
done
grep -q '^probing' "$STATE/probe.out" || fail "the write probe did not start: $(tail -5 "$STATE/probe.err")"
sleep 3
v_before=$(versions_now)
SKIP_CRASH=$PROJECT-$old-1
compose kill -s SIGKILL "$old" >/dev/null 2>&1
# the kill's time: when the engine saw the container die (the compose client takes a while)
t_kill=$(python3 -c "import sys, datetime as dt; h, _, f = sys.argv[1].rstrip('Z').partition('.')
print(dt.datetime.fromisoformat(h).replace(tzinfo=dt.timezone.utc).timestamp() + float('0.' + (f or '0')))" \
  "$(docker inspect -f '{{.State.FinishedAt}}' "$(compose ps -a -q "$old")")")
log "killed the primary $old at $t_kill (fragment versions summed: $v_before)"
new=
for _ in $(seq 300); do  # 0.2 s apart, 60 s
  p=$(primary_of sentinel-2)
  if [ -n "$p" ] && [ "$p" != "$old" ]; then new=$p; switch_s=$(since "$t_kill"); break; fi
  fail_if_crashed
  sleep 0.2
done
[ -n "$new" ] || fail "no sentinel promoted a replica within 60 s of the kill"
# the switch's time as the sentinels logged it ("+switch-master", UTC, ms; the poll above is
# slower than that on a busy host)
switch_s=$(compose logs --no-log-prefix sentinel-1 sentinel-2 sentinel-3 2>/dev/null \
  | python3 -c "import sys, datetime as dt
ts = [dt.datetime.strptime(' '.join(l.split()[1:5]), '%d %b %Y %H:%M:%S.%f').replace(
      tzinfo=dt.timezone.utc).timestamp() for l in sys.stdin if '+switch-master' in l]
print(f'{min(ts) - float(sys.argv[1]):.2f}' if ts else sys.argv[2])" "$t_kill" "$switch_s")
log "the sentinels promoted $new ${switch_s} s after the kill"
publish_s=
for _ in $(seq 180); do
  # two versions past the kill: publishes acknowledged by the new primary
  if [ "$(versions_now)" -ge $((v_before + 2)) ]; then publish_s=$(since "$t_kill"); break; fi
  fail_if_crashed
  sleep 1
done
[ -n "$publish_s" ] || fail "the fragments' versions did not move on within 180 s of the kill"
log "versions moved on (+2) ${publish_s} s after the kill (seen through ddiloco status)"
wait "$probe_pid" || fail "the write probe failed: $(tail -5 "$STATE/probe.out" "$STATE/probe.err")"
probe_json=$(tail -1 "$STATE/probe.out")
log "write probe: $probe_json"
[ -s "$STATE/probe.err" ] && { log "write probe's errors:"; tail -20 "$STATE/probe.err" >&2; }
kill_to_write_s=$(echo "$probe_json" | jq_py "round(d['gap_to'] - $t_kill, 2) if d['gap_from'] <= $t_kill <= d['gap_to'] else 'null'")
[ "$kill_to_write_s" != null ] || fail "the probe's longest gap is not the kill's: $probe_json"
log "kill to the next replicated write: ${kill_to_write_s} s (redis-ha-stop: names in its hosts file)"
kill_to_write_dns_s=null  # informative: the evaluator may be restarted by the failover
if wait "$probe2_pid"; then
  probe2_json=$(tail -1 "$STATE/probe2.out")
  kill_to_write_dns_s=$(echo "$probe2_json" | jq_py "round(d['gap_to'] - $t_kill, 2) if d['gap_from'] <= $t_kill <= d['gap_to'] else 'null'")
  log "kill to the next replicated write: ${kill_to_write_dns_s} s (evaluator: engine DNS): $probe2_json"
else
  log "the evaluator's write probe did not finish: $(tail -3 "$STATE/probe2.out" "$STATE/probe2.err")"
fi
failover_json=$(compose exec -T redis-ha-stop python - merges "$t_kill" <docker/check-failover.py) \
  || fail "training across the failover (docker/check-failover.py)"
log "merges: $failover_json"
kill_to_merge_s=$(echo "$failover_json" | jq_py 'd["kill_to_next_merge_s"]')
merge_gap_s=$(echo "$failover_json" | jq_py 'd["merge_gap_s"]')
usual_gap_s=$(echo "$failover_json" | jq_py 'd["median_gap_before_s"]')
blobs_json=$(check_blobs) || fail "a head points at a missing object after the failover"
log "blobs: $blobs_json"

# -- H3. the old primary comes back as a replica of the new one ------------------------------------
step "start $old again: it rejoins as a replica of $new"
t_start_old=$(now)
compose start "$old" >/dev/null 2>&1
SKIP_CRASH=none
back_s=
for _ in $(seq 120); do
  info=$(node_info "$old")
  if echo "$info" | grep -q '^role:slave$' && echo "$info" | grep -q "^master_host:$new$" \
     && echo "$info" | grep -q '^master_link_status:up$'; then
    back_s=$(since "$t_start_old"); break
  fi
  fail_if_crashed
  sleep 1
done
[ -n "$back_s" ] || fail "$old is not a replica of $new 120 s after its restart: $info"
[ "$(node_info "$new" | grep '^connected_slaves:')" = "connected_slaves:2" ] \
  || fail "$new has not 2 replicas: $(node_info "$new")"
log "$old is a replica of $new again ${back_s} s after its restart"
else
# -- 4b. kill the object store, start it again: publishes retry, then resume --------------------
step "kill the object store and check publishes resume"
v_before=$(versions_now)
SKIP_CRASH=$PROJECT-blobs-1
compose kill -s SIGKILL blobs >/dev/null 2>&1
log "killed blobs (fragment versions summed: $v_before)"
sleep 5
t_blobs=$SECONDS
compose start blobs >/dev/null 2>&1
SKIP_CRASH=none
blobs_s=
for _ in $(seq 180); do
  # two versions past the kill: publishes written after the restart, not one in flight at it
  if [ "$(versions_now)" -ge $((v_before + 2)) ]; then blobs_s=$((SECONDS - t_blobs)); break; fi
  fail_if_crashed
  sleep 1
done
[ -n "$blobs_s" ] || fail "no publish within 180 s of the object store's restart"
log "publishes resumed ${blobs_s} s after the object store's restart"
blobs_json=$(check_blobs) || fail "a head points at a missing object after the object store's restart"
log "blobs: $blobs_json"

# -- 5. kill one learner, restart it, it rejoins ------------------------------------------------
step "kill $LEARNER and check it rejoins"
inc_before=$(status_json | jq_py "d['learners']['$LEARNER']['incarnation']")
SKIP_CRASH=$PROJECT-$LEARNER-1
compose kill -s SIGKILL "$LEARNER" >/dev/null 2>&1
log "killed $LEARNER (incarnation $inc_before)"
sleep 2
t_kill=$SECONDS
compose start "$LEARNER" >/dev/null 2>&1
SKIP_CRASH=none
rejoin_s=
for _ in $(seq 180); do
  st=$(status_json || echo '{}')
  ok=$(echo "$st" | jq_py "int(d.get('learners', {}).get('$LEARNER', {}).get('incarnation', 0) > $inc_before and d['learners']['$LEARNER'].get('state') == 'training')" 2>/dev/null || echo 0)
  if [ "$ok" = 1 ]; then rejoin_s=$((SECONDS - t_kill)); break; fi
  fail_if_crashed
  sleep 1
done
[ -n "$rejoin_s" ] || fail "$LEARNER did not rejoin within 180 s"
log "$LEARNER rejoined (training again) ${rejoin_s} s after its restart"
blobs_json=$(check_blobs) || fail "blobs are not in the object store $BLOBS_URL after the rejoin"
log "blobs: $blobs_json"

# -- 6. metrics: every dashboard query has data in the deployment's Prometheus -------------------
step "dashboard queries against Prometheus"
prom_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}' \
          "$(compose ps -q prometheus)" | awk '{print $1}')
python3 docker/check-dashboard.py "$prom_ip:9090" --workers 7 --timeout 180 \
  || fail "dashboard queries without data"
log "every dashboard query returns data from the deployment's Prometheus"
fi

# -- 7. the run ends on its own ---------------------------------------------------------------
step "the run ends on its own"
finish_id=$(compose ps -a -q finish)
code=
for _ in $(seq 1200); do
  state=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$finish_id")
  if [ "${state%% *}" = exited ]; then code=${state##* }; break; fi
  fail_if_crashed
  sleep 1
done
[ -n "$code" ] || fail "finish did not exit within 20 min"
compose logs --no-log-prefix finish | tail -25
[ "$code" = 0 ] || fail "finish exited $code"
[ -s "$DDILOCO_OUT/report.json" ] || fail "no $DDILOCO_OUT/report.json"
python3 - "$DDILOCO_OUT/report.json" "$LEARNER" "${inc_before:-0}" <<'PY' || fail "report checks"
import json, sys
report = json.load(open(sys.argv[1]))["diloco"]
learner, inc_before = sys.argv[2], int(sys.argv[3])
assert report["merges"] > 0, "no merge"
assert set(report["per_learner"]) == {f"learner-{i}" for i in range(4)}, report["per_learner"]
assert report["final_val_loss"] is not None, "no final evaluation"
assert not any(report["dropped"].values()), report["dropped"]
print(json.dumps({"per_learner_tokens_per_s": {k: v["tokens_per_s"]
                                               for k, v in report["per_learner"].items()},
                  "final_val_loss": report["final_val_loss"], "merges": report["merges"]}))
PY
services=(shard-0 shard-1 evaluator router-a router-b router-c blobs)
# profile ha: the nodes and sentinels too, which redis-ha-stop ends after finish's shutdown
[ "$MODE" = ha ] && services+=(redis redis-1 redis-2 sentinel-1 sentinel-2 sentinel-3 redis-ha-stop)
for svc in "${services[@]}"; do
  # the object store stops once finish has shut Redis down: give it a few seconds
  for _ in $(seq 60); do
    state=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$(compose ps -a -q "$svc")")
    [ "${state%% *}" = running ] || break
    sleep 1
  done
  [ "$state" = "exited 0" ] || fail "$svc is '$state' after the run, not 'exited 0'"
done
run_s=$((SECONDS - t_up))
log "the run ended on its own ${run_s} s after up; every service exited 0"
[ "$MODE" = ha ] && compose logs --no-log-prefix redis-ha-stop | tail -8 >&2
if [ "$MODE" = ha ]; then
  printf '{"compose_test": "passed", "mode": "ha", "base_images_s": %d, "ddiloco_image_s": %d, "first_merge_s": %d, "promoted": "%s", "kill_to_switch_s": %s, "kill_to_next_write_s": %s, "kill_to_next_write_engine_dns_s": %s, "kill_to_next_merge_s": %s, "merge_gap_s": %s, "median_merge_gap_before_s": %s, "kill_to_versions_plus_2_s": %s, "old_primary_replica_again_s": %s, "run_s": %d, "total_s": %d}\n' \
    "$base_s" "$build_s" "$first_merge_s" "$new" "$switch_s" "$kill_to_write_s" "$kill_to_write_dns_s" "$kill_to_merge_s" "$merge_gap_s" "$usual_gap_s" "$publish_s" "$back_s" "$run_s" $((SECONDS - t_start))
  exit 0
fi
printf '{"compose_test": "passed", "base_images_s": %d, "ddiloco_image_s": %d, "first_merge_s": %d, "blobs_restart_publish_s": %d, "rejoin_s": %d, "run_s": %d, "total_s": %d}\n' \
  "$base_s" "$build_s" "$first_merge_s" "$blobs_s" "$rejoin_s" "$run_s" $((SECONDS - t_start))
