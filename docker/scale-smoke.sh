#!/usr/bin/env bash
# The scale-out profile of docker/compose.yaml, built and run for real with Podman (podman-compose):
# redis, three kvserve replicas sharing nothing but Redis, nginx in front on 127.0.0.1:8080.
# Follows ../shared/CONTAINERS.md through docker/podman-lib.sh (debootstrap base, no registry).
# Checks: every replica ready behind nginx; a session's turns stay on one replica (device hit); that
# replica's container killed, the next turn is served by another one, restored from Redis
# (X-Cache-Source: shared), its prompt exactly the transcript plus the new message; Redis holds blocks.
# Exits non-zero on any failure; takes the whole project down (volumes included) at the end.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SCRATCH="$ROOT/docker/.build"
PY=${PY:-python3}
PROJECT=kvscale
BASE_URL=http://127.0.0.1:8080
MODEL=smollm2-135m-instruct
T0=$(date +%s)

step() { printf '\n[%4ss] == %s\n' "$(($(date +%s) - T0))" "$*"; }
fail() { echo "SCALE SMOKE FAILED: $*" >&2; compose logs --tail 20 2>&1 | tail -80 >&2 || true; exit 1; }

# shellcheck source=docker/podman-lib.sh
source "$ROOT/docker/podman-lib.sh"
podman_setup
podman_base
podman_build_kvserve localhost/kvserve:cpu

step "podman-compose"
"$PY" -m podman_compose version >/dev/null 2>&1 || "$PY" -m pip install --quiet "podman-compose>=1.1"
export KVSERVE_BASE=cpu
compose() { "$PY" -m podman_compose --profile scale -p "$PROJECT" -f "$ROOT/docker/compose.yaml" "$@"; }
cleanup() { compose down -v >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup

step "build the redis and nginx images (same Debian base)"
compose build redis nginx

step "up: redis, kvserve-1..3, nginx"
compose up -d redis redis-blocks kvserve-1 kvserve-2 kvserve-3 nginx

step "every replica ready behind nginx (each converts the model into its own volume first)"
header() { grep -i "^$1:" | head -n1 | cut -d' ' -f2; }
declare -A seen=()
for _ in $(seq 1 600); do
    code=$(curl -s -o /dev/null -D "$SCRATCH/ready.headers" -w '%{http_code}' "$BASE_URL/ready" || true)
    if [ "$code" = 200 ]; then
        seen[$(tr -d '\r' <"$SCRATCH/ready.headers" | header x-kvserve-replica)]=1
    fi
    [ "${#seen[@]}" = 3 ] && break
    sleep 1
done
[ "${#seen[@]}" = 3 ] || fail "not every replica became ready: ${!seen[*]}"
echo "ready: ${!seen[*]}"

turn() {  # $1: messages JSON -> writes $SCRATCH/turn.json, prints the response headers
    curl -s -D - -o "$SCRATCH/turn.json" "$BASE_URL/v1/chat/completions" -H 'Content-Type: application/json' \
        -H 'X-Session-ID: scale-smoke' \
        -d "{\"model\": \"$MODEL\", \"max_tokens\": 12, \"temperature\": 0, \"messages\": $1}" | tr -d '\r'
}
field() { "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))$1)" "$SCRATCH/turn.json"; }
as_json() { "$PY" -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$1"; }

step "turns 1 and 2 on session 'scale-smoke': one replica, the second a device hit"
q1='[{"role": "user", "content": "Name a large river."}]'
h1=$(turn "$q1")
home=$(echo "$h1" | header x-kvserve-replica)
a1=$(field '["choices"][0]["message"]["content"]')
echo "turn 1 on $home: $a1"
q2="[{\"role\": \"user\", \"content\": \"Name a large river.\"}, {\"role\": \"assistant\", \"content\": $(as_json "$a1")}, {\"role\": \"user\", \"content\": \"And a mountain?\"}]"
h2=$(turn "$q2")
[ "$(echo "$h2" | header x-kvserve-replica)" = "$home" ] || fail "turn 2 left its replica $home"
[ "$(echo "$h2" | header x-cache-source)" = device ] || fail "turn 2 was not a device hit: $h2"
a2=$(field '["choices"][0]["message"]["content"]')
transcript=$(($(field '["usage"]["prompt_tokens"]') + $(field '["usage"]["completion_tokens"]')))
echo "turn 2 on $home, transcript now $transcript tokens"

step "Redis holds the session's K/V blocks"
blocks=$(podman exec "${PROJECT}_redis-blocks_1" redis-cli --scan --pattern 'kvserve:blk:*' | wc -l)
echo "$blocks blocks in Redis"
[ "$blocks" -gt 0 ] || fail "no K/V block in Redis"

step "kill $home's container; turn 3 is served elsewhere, restored from Redis"
podman kill "${PROJECT}_${home}_1" >/dev/null
q3="${q2%]}, {\"role\": \"assistant\", \"content\": $(as_json "$a2")}, {\"role\": \"user\", \"content\": \"And a lake?\"}]"
h3=$(turn "$q3")
echo "$h3" | grep -i '^x-'
other=$(echo "$h3" | header x-kvserve-replica)
[ -n "$other" ] && [ "$other" != "$home" ] || fail "turn 3 was not served by another replica"
[ "$(echo "$h3" | header x-cache-source)" = shared ] || fail "turn 3 did not restore the K/V from Redis"
cached=$(field '["usage"]["prompt_tokens_details"]["cached_tokens"]')
[ "$cached" -ge $((transcript - 16)) ] || fail "only $cached of the $transcript transcript tokens were restored"
echo "turn 3 on $other: $cached tokens restored from Redis; $(field '["choices"][0]["message"]["content"]')"
turns=$(curl -s "$BASE_URL/v1/sessions/scale-smoke" -H 'X-Session-ID: scale-smoke' | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["turns"])')
[ "$turns" = 3 ] || fail "the session has $turns turns, not 3"

step "SCALE SMOKE PASSED"
