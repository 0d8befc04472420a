#!/usr/bin/env bash
# Bring the CPU profile of deploy/ up for real and check it: podman + podman-compose (runc), images
# built here from Debian's packages and the pinned wheels, serving the demo checkpoints.
#
#   bash scripts/test-compose.sh [--report FILE]     # as root; .ci/run calls it after the tests
#
# Steps (each timed): install podman, runc, debootstrap and podman-compose if missing; build the
# Debian root image, the shared Python base and the service images; bring up triton, drafter,
# orchestrator and prometheus; send a Generate through the published port; check Prometheus scrapes
# every target; kill the orchestrator's main process and check the restart policy brings it back
# and it serves again; kill -9 tritonserver under 12 streams and check each one ends with the
# tokens of a run without the kill; kill Triton's Python stub and check Triton is restarted;
# bring everything down (also on failure). Nothing is cached between runs:
# images from an earlier run are removed first, and again at the end (KEEP_IMAGES=1 keeps them).
# Any failed check exits non-zero with the services' logs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

REPORT=""
if [ "${1:-}" = "--report" ]; then REPORT=$2; fi

# Podman's settings live in the repository, not in /etc (see deploy/containers.conf).
export CONTAINERS_CONF=$ROOT/deploy/containers.conf
# Docker's image format: OCI images drop HEALTHCHECK.
export BUILDAH_FORMAT=docker
PODMAN_COMPOSE_VERSION=1.6.0   # 1.0.3 (Debian 12) has no !reset, which deploy/docker-compose.cpu.yml uses
SERVICES=(triton drafter orchestrator prometheus)
RESTART_SERVICE=orchestrator
# Streams cut by the kill of tritonserver (triton_kill_check), and the tokens of each.
KILL_STREAMS=${KILL_STREAMS:-12}
KILL_TOKENS=${KILL_TOKENS:-192}
# The client and the wheel download run on the host: the project's venv (CI's test suite made it).
PY=${PYTHON:-$ROOT/.venv/bin/python}

WORK=$(mktemp -d /var/tmp/flashmap-compose.XXXXXX)
T0=$SECONDS
declare -a TIMES=()   # "what|seconds" rows for the table
declare -a CHECKS=()  # "check|result" rows

log() { printf '[%4ds] %s\n' $((SECONDS - T0)) "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }
timed() {  # timed LABEL CMD...: run CMD, record its wall time under LABEL
  local label=$1 t=$SECONDS; shift
  log "$label ..."
  "$@"
  TIMES+=("$label|$((SECONDS - t))")
}

# --------------------------------------------------------------------------- prerequisites

install_tools() {
  local missing=()
  command -v podman >/dev/null || missing+=(podman)
  command -v runc >/dev/null || missing+=(runc)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  # netavark + aardvark-dns: the compose network, where services find each other by name.
  [ -x /usr/lib/podman/netavark ] || missing+=(netavark)
  [ -x /usr/lib/podman/aardvark-dns ] || missing+=(aardvark-dns)
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "not root: install ${missing[*]} first"
    log "apt-get install ${missing[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${missing[@]}" iptables uidmap debian-archive-keyring >/dev/null
  fi
  [ -x "$PY" ] || bash scripts/setup.sh
  "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
    || die "$PY is not Python 3.11 (the images' Python; the wheels are downloaded for it)"
  # podman-compose from PyPI, pinned, in a scratch venv of this run.
  "$PY" -m venv "$WORK/tools"
  "$WORK/tools/bin/pip" install -q "podman-compose==$PODMAN_COMPOSE_VERSION" 2>&1 | { grep -v '^WARNING: Location' || true; }
  [ -x "$WORK/tools/bin/podman-compose" ] || die "podman-compose did not install"
}

# --------------------------------------------------------------------------- compose

free_ports() {  # N free TCP ports on 127.0.0.1 (other jobs on this machine may hold the defaults)
  python3 - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

read -r ORCHESTRATOR_PORT ORCHESTRATOR_HTTP_PORT ORCHESTRATOR_METRICS_PORT PROMETHEUS_PORT GRAFANA_PORT \
  <<<"$(free_ports 5)"
export ORCHESTRATOR_PORT ORCHESTRATOR_HTTP_PORT ORCHESTRATOR_METRICS_PORT PROMETHEUS_PORT GRAFANA_PORT
# The secrets between the parts and the API key clients send (the client SDK reads FLASHMAP_API_KEY).
secret() { "$PY" -c 'import secrets; print(secrets.token_urlsafe(32))'; }
FLASHMAP_TARGET_KEY=$(secret) FLASHMAP_DRAFTER_TOKEN=$(secret) FLASHMAP_API_KEY=$(secret)
export FLASHMAP_TARGET_KEY FLASHMAP_DRAFTER_TOKEN FLASHMAP_API_KEY
export ORCHESTRATOR_BIND=127.0.0.1   # tests listen on loopback only
export FLASHMAP_TARGET_HOST_DIR=$ROOT/checkpoints/demo-target
export FLASHMAP_DRAFTER_HOST_DIR=$ROOT/checkpoints/demo-flashmap-eq
export FLASHMAP_TAG=cpu
# Grafana is not started on the CPU profile, but the compose file requires its secret's path.
export GRAFANA_ADMIN_PASSWORD_FILE=$WORK/grafana_admin_password
head -c 18 /dev/urandom | base64 >"$GRAFANA_ADMIN_PASSWORD_FILE"

compose() {
  "$WORK/tools/bin/podman-compose" -f deploy/docker-compose.yml -f deploy/docker-compose.cpu.yml "$@"
}
ctr() { echo "flashmap-serve_$1_1"; }   # podman-compose's container name for a service

IMAGES=(localhost/flashmap/debian:bookworm localhost/flashmap/python:cpu localhost/flashmap/prometheus:cpu
        localhost/flashmap/triton:cpu localhost/flashmap/drafter:cpu localhost/flashmap/orchestrator:cpu)

remove_stack() {  # containers, network and volumes of this project, whatever state they are in
  compose down -v -t 10 >/dev/null 2>&1 || true
  podman pod rm -f pod_flashmap-serve >/dev/null 2>&1 || true
}

cleanup() {
  local rc=$?
  set +e
  if [ $rc -ne 0 ]; then
    for s in "${SERVICES[@]}"; do
      podman container exists "$(ctr "$s")" || continue
      echo "----- logs: $s (last 40 lines)" >&2
      podman logs --tail 40 "$(ctr "$s")" >&2 2>&1
    done
  fi
  log "bringing the stack down"
  remove_stack
  if [ "${KEEP_IMAGES:-0}" != 1 ]; then
    podman rmi -f "${IMAGES[@]}" >/dev/null 2>&1
    podman image prune -f >/dev/null 2>&1
  fi
  rm -rf "$WORK"
  log "$([ $rc -eq 0 ] && echo PASSED || echo "FAILED (exit $rc)") in $((SECONDS - T0)) s"
}

# --------------------------------------------------------------------------- checks

wait_healthy() {  # wait_healthy SERVICE TIMEOUT_S: run the service's own health check until it passes
  # Podman schedules health checks with systemd timers; without systemd (as here) nothing runs
  # them, so this does: `podman healthcheck run` executes the check of the compose file and
  # records its result, as the timer would.
  local c t=$SECONDS
  c=$(ctr "$1")
  until podman healthcheck run "$c" >/dev/null 2>&1; do
    [ $((SECONDS - t)) -lt "$2" ] \
      || die "$1 not healthy after $2 s (state: $(podman inspect -f '{{.State.Status}}, exit code {{.State.ExitCode}}, restarts {{.RestartCount}}' "$c" 2>&1))"
    sleep 1
  done
}

generate() {  # generate LABEL: one Generate through the published port, with the project's client
  local out
  # 32 tokens whatever the text (ignore_eos): the demo target may end early on a raw prompt.
  out=$(PYTHONPATH=$ROOT "$PY" - "127.0.0.1:$ORCHESTRATOR_PORT" 2>&1 <<'EOF'
import sys, time
from flashmap.client import Client
t = time.perf_counter()
with Client(sys.argv[1], timeout=120) as c:
    out = c.generate(prompt="def add(a, b):", max_new_tokens=32, ignore_eos=True)
s = out.stats
print(f"{len(out.token_ids)} tokens, finish={out.finish_reason}, gamma {s.mean_acceptance_length:.2f}, "
      f"{s.rounds} rounds ({s.fallback_rounds} without a draft), TTFT {out.time_to_first_token_s * 1e3:.0f} ms, "
      f"{time.perf_counter() - t:.2f} s: {out.text[:48]!r}")
if len(out.token_ids) != 32 or out.finish_reason != "length" or s.rounds < 1:
    sys.exit("expected 32 tokens, finish=length, at least one round")
EOF
  ) || die "Generate ($1) failed: $out"
  log "Generate ($1): $out"
  CHECKS+=("Generate ($1)|${out//|/\\|}")
}

openai_request() {  # one /v1/chat/completions through the published HTTP port, with the API key
  local out
  out=$("$PY" - "http://127.0.0.1:$ORCHESTRATOR_HTTP_PORT" 2>&1 <<'EOF'
import json, os, sys, urllib.error, urllib.request
base, key = sys.argv[1], os.environ["FLASHMAP_API_KEY"]
auth = {"Authorization": f"Bearer {key}"}
models = json.load(urllib.request.urlopen(urllib.request.Request(base + "/v1/models", headers=auth), timeout=30))
body = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "What can you do?"}],
        "max_tokens": 32, "temperature": 0}
req = lambda key: urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
try:
    urllib.request.urlopen(req("wrong"), timeout=60)
    sys.exit("a request with a wrong API key was served")
except urllib.error.HTTPError as e:
    assert e.code == 401, e.code
r = json.load(urllib.request.urlopen(req(key), timeout=120))
text, spec = r["choices"][0]["message"]["content"], r["flashmap"]
assert text and r["usage"]["completion_tokens"] > 0, r
print(f"{r['usage']['completion_tokens']} tokens, finish={r['choices'][0]['finish_reason']}, "
      f"gamma {spec['mean_acceptance_length']:.2f}; a wrong key got 401: {text[:48]!r}")
EOF
  ) || die "OpenAI request failed: $out"
  log "OpenAI: $out"
  CHECKS+=("OpenAI /v1/chat/completions|$out")
}

stub_kill_check() {  # kill -9 Triton's Python stub: the launcher's watchdog exits, podman restarts Triton
  local c before after t pid
  c=$(ctr triton)
  before=$(podman inspect -f '{{.RestartCount}}' "$c")
  pid=$(podman top "$c" hpid args | awk '/triton_python_backend_stub/ {print $1; exit}')
  [ -n "$pid" ] || die "no triton_python_backend_stub in the triton container"
  log "kill -9 Triton's Python stub (host pid $pid)"
  t=$SECONDS
  kill -9 "$pid"
  after=$(await_restart triton "$before" "$t" 120)
  TIMES+=("triton: stub killed to restarted (launcher watchdog)|$((SECONDS - t))")
  wait_healthy triton 300
  # The orchestrator said NOT_SERVING while the target could not verify; it must say SERVING again.
  wait_healthy orchestrator 120
  TIMES+=("triton: stub killed to Triton and the orchestrator healthy again|$((SECONDS - t))")
  CHECKS+=("Triton stub kill -9|restart count $before -> $after, healthy again after $((SECONDS - t)) s")
  generate "after the Triton restart"
}

triton_kill_check() {  # kill -9 tritonserver under concurrent streams: each ends as it would have
  local c before after t pid out
  c=$(ctr triton)
  before=$(podman inspect -f '{{.RestartCount}}' "$c")
  pid=$(podman top "$c" hpid args | awk '$2 ~ /(^|\/)tritonserver$/ {print $1; exit}')
  [ -n "$pid" ] || die "no tritonserver in the triton container"
  log "kill -9 tritonserver (host pid $pid) under $KILL_STREAMS streams"
  t=$SECONDS
  # The streams run twice: without a kill (the reference), then with tritonserver killed once
  # every stream has tokens. The orchestrator keeps what each committed, waits for the
  # restarted Triton and continues them (orchestrator.resume): the same tokens, no error.
  out=$(PYTHONPATH=$ROOT "$PY" - "127.0.0.1:$ORCHESTRATOR_PORT" "$pid" \
        "http://127.0.0.1:$ORCHESTRATOR_METRICS_PORT/metrics" "$KILL_STREAMS" "$KILL_TOKENS" 2>&1 <<'EOF'
import asyncio, os, signal, sys, time
from flashmap.client import AsyncClient
from flashmap.metrics import scrape, totals
url, pid, metrics, n, max_new = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
prompts = [f"def f{i}(x):\n    return" for i in range(n)]

async def run(kill: bool):
    got, cut, t_kill = [[] for _ in prompts], 0, 0.0
    async with AsyncClient(url, timeout=600) as c:
        async def one(i):
            async for ch in c.generate_stream(prompt=prompts[i], max_new_tokens=max_new, ignore_eos=True):
                if ch.finished:
                    return ch.finish_reason
                got[i].extend(ch.token_ids)
        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        if kill:
            while not all(len(g) >= 8 for g in got):
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            t_kill, cut = time.perf_counter(), sum(len(g) < max_new for g in got)
        finish = await asyncio.gather(*tasks, return_exceptions=True)
    bad = [f for f in finish if f != "length"]
    if bad:
        sys.exit(f"{len(bad)} of {n} streams did not end with finish=length: {bad[:3]}")
    return got, cut, time.perf_counter() - t_kill

want, _, _ = asyncio.run(run(False))
resumed0 = totals(scrape(metrics)).get("flashmap_resumed_requests_total", 0)
got, cut, after = asyncio.run(run(True))
resumed = totals(scrape(metrics)).get("flashmap_resumed_requests_total", 0) - resumed0
same = sum(g == w for g, w in zip(got, want))
print(f"{n} streams of {max_new} tokens, {cut} cut by the kill and {resumed:.0f} resumed; all ended "
      f"{after:.1f} s after the kill, {same} of {n} with the tokens of the run without it")
if same < n or cut == 0 or resumed < cut:
    sys.exit("a stream differs from the run without the kill" if same < n else "no stream resumed")
EOF
  ) || die "tritonserver kill -9 under $KILL_STREAMS streams: $out"
  log "tritonserver kill -9: $out"
  after=$(await_restart triton "$before" "$t" 120)
  TIMES+=("triton: kill -9 of tritonserver under $KILL_STREAMS streams to every stream ended|$((SECONDS - t))")
  wait_healthy triton 300
  wait_healthy orchestrator 120
  CHECKS+=("tritonserver kill -9 under $KILL_STREAMS streams|restart count $before -> $after; $out")
}

prometheus_targets_up() {  # every scrape target healthy, through Prometheus' HTTP API
  local t=$SECONDS summary
  until summary=$("$PY" - "http://127.0.0.1:$PROMETHEUS_PORT" <<'EOF'
import json, sys, urllib.parse, urllib.request
base = sys.argv[1]
targets = json.load(urllib.request.urlopen(base + "/api/v1/targets", timeout=5))["data"]["activeTargets"]
jobs = {t["labels"]["job"]: t["health"] for t in targets}
want = {"flashmap-orchestrator", "flashmap-drafter", "triton", "prometheus"}
assert set(jobs) == want and all(h == "up" for h in jobs.values()), jobs
# The request sent above reached Prometheus through the orchestrator's /metrics.
q = urllib.parse.quote('sum(flashmap_requests_total{status="length"})')
res = json.load(urllib.request.urlopen(f"{base}/api/v1/query?query={q}", timeout=5))["data"]["result"]
assert res and float(res[0]["value"][1]) >= 1, res
print(", ".join(f"{j} {h}" for j, h in sorted(jobs.items())) + f"; flashmap_requests_total = {res[0]['value'][1]}")
EOF
  ); do
    [ $((SECONDS - t)) -lt 60 ] || die "Prometheus targets not all up after 60 s"
    sleep 2
  done
  log "Prometheus: $summary"
  CHECKS+=("Prometheus targets (HTTP API)|$summary")
}

await_restart() {  # await_restart SERVICE BEFORE T0 TIMEOUT_S: prints the restart count once it passes BEFORE
  local c after
  c=$(ctr "$1")
  until after=$(podman inspect -f '{{.RestartCount}}' "$c") && [ "$after" -gt "$2" ] \
      && [ "$(podman inspect -f '{{.State.Status}}' "$c")" = running ]; do
    [ $((SECONDS - $3)) -lt "$4" ] || die "$1 not restarted $4 s after the kill"
    sleep 1
  done
  echo "$after"
}

restart_check() {  # kill the service's main process; the restart policy must bring it back serving
  local c pid before after t
  c=$(ctr "$RESTART_SERVICE")
  pid=$(podman inspect -f '{{.State.Pid}}' "$c")
  before=$(podman inspect -f '{{.RestartCount}}' "$c")
  log "kill -9 $RESTART_SERVICE's main process (host pid $pid)"
  t=$SECONDS
  kill -9 "$pid"
  after=$(await_restart "$RESTART_SERVICE" "$before" "$t" 60)
  TIMES+=("$RESTART_SERVICE: kill -9 to restarted by podman|$((SECONDS - t))")
  wait_healthy "$RESTART_SERVICE" 180
  TIMES+=("$RESTART_SERVICE: kill -9 to healthy again|$((SECONDS - t))")
  CHECKS+=("Restart of $RESTART_SERVICE after kill -9|restart count $before -> $after, healthy again after $((SECONDS - t)) s")
  generate "after the restart"
}

image_sizes() {
  local base img size
  base=$(podman image inspect -f '{{.Size}}' localhost/flashmap/python:cpu)
  for img in "${IMAGES[@]}"; do
    size=$(podman image inspect -f '{{.Size}}' "$img")
    case $img in
      */triton:*|*/drafter:*|*/orchestrator:*)
        SIZES+=("$img|$((size / 1000000)) MB|its own layers: $(awk -v d=$((size - base)) 'BEGIN{printf "%.1f", d / 1e6}') MB above the shared base") ;;
      *) SIZES+=("$img|$((size / 1000000)) MB|") ;;
    esac
  done
}

# --------------------------------------------------------------------------- run

trap cleanup EXIT
trap 'exit 130' INT TERM   # through cleanup, with a failing status
declare -a SIZES=()
timed "install tools (podman, runc, debootstrap, podman-compose)" install_tools
log "podman $(podman --version | awk '{print $3}'), runc $(runc --version | awk 'NR==1{print $3}'), podman-compose $PODMAN_COMPOSE_VERSION"
remove_stack
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  # For working on the checks: the images of an earlier KEEP_IMAGES=1 run. Not for CI.
  log "SKIP_BUILD=1: using the images already built"
else
podman rmi -f "${IMAGES[@]}" >/dev/null 2>&1 || true   # build from nothing, every run

timed "build: Debian root image (debootstrap + import)" deploy/base/debian.sh
download_wheels() {  # every wheel of the lock, checked against its hash, into this run's folder
  "$PY" -m pip download -q --no-deps --only-binary=:all: --require-hashes \
    -r deploy/requirements/cpu.lock -d "$WORK/wheels" 2>&1 | { grep -v '^WARNING: Location' || true; }
}
timed "download the pinned wheels (cpu.lock)" download_wheels
timed "build: shared Python base" \
  podman build -q -f deploy/base/Containerfile.python -v "$WORK/wheels:/wheels:ro" \
  -t localhost/flashmap/python:cpu deploy
timed "build: service images + prometheus (podman-compose build)" compose build "${SERVICES[@]}"
fi
image_sizes

t_up=$SECONDS
timed "up (podman-compose up -d)" compose up -d "${SERVICES[@]}"
for s in "${SERVICES[@]}"; do
  wait_healthy "$s" 300
  TIMES+=("$s healthy, from the start of up|$((SECONDS - t_up))")
done

generate "first"
openai_request
prometheus_targets_up
restart_check
triton_kill_check
stub_kill_check

timed "down (podman-compose down -v)" remove_stack
TOTAL=$((SECONDS - T0))

# --------------------------------------------------------------------------- report

{
  echo "| step | seconds |"
  echo "|---|---:|"
  for row in "${TIMES[@]}"; do echo "| ${row%%|*} | ${row#*|} |"; done
  echo "| **total** | **$TOTAL** |"
  echo
  echo "| image | size | |"
  echo "|---|---:|---|"
  for row in "${SIZES[@]}"; do IFS='|' read -r a b c <<<"$row"; echo "| \`$a\` | $b | $c |"; done
  echo
  echo "| check | result |"
  echo "|---|---|"
  for row in "${CHECKS[@]}"; do echo "| ${row%%|*} | ${row#*|} |"; done
  echo
  echo "Run $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(nproc) cores, $(free -g | awk '/^Mem:/{print $2}') GiB," \
       "$(. /etc/os-release; echo "$PRETTY_NAME"), podman $(podman --version | awk '{print $3}')," \
       "runc $(runc --version | awk 'NR==1{print $3}'), podman-compose $PODMAN_COMPOSE_VERSION;" \
       "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)."
} >"$WORK/report.md"
cat "$WORK/report.md"
[ -z "$REPORT" ] || cp "$WORK/report.md" "$REPORT"
skipped=$(printf '%s\n' "${CHECKS[@]}" | grep -c '|skipped' || true)
echo "compose: $((${#CHECKS[@]} - skipped)) passed, 0 failed, $skipped skipped"
