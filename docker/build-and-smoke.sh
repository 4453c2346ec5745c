#!/usr/bin/env bash
# Build a variant of the image with Podman and smoke-test a running container on this machine's CPU.
#   docker/build-and-smoke.sh                 the CPU variant (BASE=cpu, torch from a local wheelhouse)
#   TARGET=cuda docker/build-and-smoke.sh     the Dockerfile's default, GPU variant (torch's CUDA build
#                                             from PyPI, several GB); it runs here on the CPU
# Follows ../shared/CONTAINERS.md: a debootstrap base (no registry), engine config in a scratch
# containers.conf (nothing written under /etc).
# Checks (the GPU variant first: a CUDA build of torch, triton, a C compiler and the Python headers): /ready,
# the warning about running without API keys, a streamed chat turn on a session, a second turn reporting cached tokens,
# the HEALTHCHECK, a non-root process, `podman stop` ending it with exit code 0, and after a restart on
# the same volume the session listed with its turns and its next turn's K/V restored from disk.
# Exits non-zero on any failure; removes the container and volumes it started.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SCRATCH="$ROOT/docker/.build"
TARGET=${TARGET:-cpu}
case "$TARGET" in cpu | cuda) ;; *) echo "TARGET must be cpu or cuda, not '$TARGET'" >&2; exit 2 ;; esac
IMAGE=${IMAGE:-localhost/kvserve:$TARGET-smoke}
NAME=kvserve-smoke-$$
PORT=${PORT:-18000}
STOP_TIMEOUT=${STOP_TIMEOUT:-30}  # above KVSERVE_SHUTDOWN_GRACE_S (10 s by default)
PY=${PY:-python3}
MODEL=smollm2-135m-instruct
T0=$(date +%s)

step() { printf '\n[%4ss] == %s\n' "$(($(date +%s) - T0))" "$*"; }
fail() { echo "SMOKE FAILED: $*" >&2; exit 1; }

cleanup() {
    podman rm -f "$NAME" >/dev/null 2>&1 || true
    podman volume rm -f "$NAME-state" "$NAME-models" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# shellcheck source=docker/podman-lib.sh
source "$ROOT/docker/podman-lib.sh"
podman_setup
podman_base
podman_build_kvserve "$IMAGE" "$TARGET"
size=$(podman image inspect "$IMAGE" --format '{{.Size}}')

if [ "$TARGET" = cuda ]; then
    step "GPU variant: torch's CUDA build, triton, a C compiler and Python headers (for Triton's launcher)"
    podman run --rm --entrypoint python3 "$IMAGE" -c '
import os, shutil, subprocess, sysconfig
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "triton", triton.__version__, "cuda available:", torch.cuda.is_available())
assert torch.version.cuda, "torch is not a CUDA build"
cc = shutil.which("gcc") or shutil.which("cc")
assert cc, "no C compiler"
src = "#include <Python.h>\nint main(void) { return Py_IsInitialized(); }\n"
subprocess.run([cc, "-fsyntax-only", "-x", "c", "-I" + sysconfig.get_paths()["include"], "-"], input=src.encode(), check=True)
print("C compiler", cc, "compiles against", sysconfig.get_paths()["include"] + "/Python.h")
for k in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
    print(k + "=" + os.environ.get(k, ""))
    assert os.environ.get(k), k + " not set"' || fail "the GPU variant lacks what it needs"
fi

step "run with the port published on 127.0.0.1:$PORT"
podman run -d --init --name "$NAME" -p "127.0.0.1:$PORT:8000" --stop-timeout "$STOP_TIMEOUT" \
    -v "$NAME-state:/var/lib/kvserve" -v "$NAME-models:/app/models" "$IMAGE" >/dev/null
base="http://127.0.0.1:$PORT"

wait_ready() {
    for _ in $(seq 1 300); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "$base/ready" || true)
        [ "$code" = 200 ] && break
        [ "$(podman inspect "$NAME" --format '{{.State.Running}}')" = true ] || { podman logs "$NAME"; fail "container exited"; }
        sleep 1
    done
    [ "$code" = 200 ] || { podman logs "$NAME" | tail -20; fail "/ready never answered 200 (last: $code)"; }
    curl -s "$base/ready"; echo
}

step "wait for /ready (first start converts the GGUF into the state volume)"
wait_ready
podman logs "$NAME" 2>&1 | grep -A 3 "NO API KEYS" || fail "no loud warning about running without API keys"

chat() {  # $1: messages JSON; prints the SSE stream
    curl -sN "$base/v1/chat/completions" -H 'Content-Type: application/json' -H 'X-Session-ID: smoke' \
        -d "{\"model\": \"$MODEL\", \"stream\": true, \"stream_options\": {\"include_usage\": true},
             \"max_tokens\": 24, \"temperature\": 0, \"messages\": $1}"
}
parse() {  # stdin: SSE stream -> "content<TAB>cached_tokens", fails on a malformed stream
    "$PY" -c '
import json, sys
lines = [l for l in sys.stdin.read().split("\n") if l.startswith("data: ")]
assert lines and lines[-1] == "data: [DONE]", "stream did not end with [DONE]"
events = [json.loads(l[6:]) for l in lines[:-1]]
assert not any("error" in e for e in events), events
text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
usage = events[-1]["usage"]
print(text.replace("\n", " ") + "\t" + str(usage["prompt_tokens_details"]["cached_tokens"]))'
}

step "turn 1: streamed chat on session 'smoke'"
q1='[{"role": "user", "content": "What is the capital of France?"}]'
IFS=$'\t' read -r answer1 cached1 < <(chat "$q1" | parse)
echo "answer: $answer1 | cached_tokens: $cached1"
[ -n "$answer1" ] || fail "empty answer"

step "turn 2: same session, cached tokens reported"
a1=$("$PY" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$answer1")
q2="[{\"role\": \"user\", \"content\": \"What is the capital of France?\"}, {\"role\": \"assistant\", \"content\": $a1}, {\"role\": \"user\", \"content\": \"And of Germany?\"}]"
IFS=$'\t' read -r answer2 cached2 < <(chat "$q2" | parse)
echo "answer: $answer2 | cached_tokens: $cached2"
[ "$cached2" -gt 0 ] || fail "second turn reported no cached tokens"
curl -s "$base/v1/sessions/smoke"; echo

step "HEALTHCHECK"
podman healthcheck run "$NAME" && echo "healthcheck: healthy" || fail "healthcheck failed"

step "runs as a non-root user"
uid=$(podman exec "$NAME" python3 -c 'import os; print(os.getuid())')
podman top "$NAME" user huser args
[ "$uid" != 0 ] || fail "the server runs as root"
echo "uid inside: $uid"

step "podman stop -t $STOP_TIMEOUT: SIGTERM handled, exit code 0"
start=$(date +%s)
podman stop -t "$STOP_TIMEOUT" "$NAME" >/dev/null
exit_code=$(podman inspect "$NAME" --format '{{.State.ExitCode}}')
echo "stopped in $(($(date +%s) - start)) s, exit code $exit_code"
podman logs "$NAME" 2>&1 | tail -4
[ "$exit_code" = 0 ] || fail "exit code $exit_code after SIGTERM"

step "restart on the same volumes: session 'smoke' is back, its K/V restored from disk"
podman start "$NAME" >/dev/null
wait_ready
restored=$(curl -s "$base/v1/sessions/smoke")
echo "$restored"
echo "$restored" | "$PY" -c '
import json, sys
s = json.load(sys.stdin)
assert s["turns"] == 2 and s["cache"]["disk"]["tokens"] > 0, s' || fail "session 'smoke' did not survive the restart"
a2=$("$PY" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$answer2")
q3="${q2%]}, {\"role\": \"assistant\", \"content\": $a2}, {\"role\": \"user\", \"content\": \"And of Italy?\"}]"
headers=$(curl -s -D - -o "$SCRATCH/turn3.json" "$base/v1/chat/completions" -H 'Content-Type: application/json' \
    -H 'X-Session-ID: smoke' -d "{\"model\": \"$MODEL\", \"max_tokens\": 24, \"temperature\": 0, \"messages\": $q3}")
echo "$headers" | grep -i '^x-cache'
cat "$SCRATCH/turn3.json"; echo
echo "$headers" | grep -qi '^x-cache-source: disk' || fail "turn 3 did not restore the session's K/V from disk"
podman stop "$NAME" >/dev/null
exit_code=$(podman inspect "$NAME" --format '{{.State.ExitCode}}')
[ "$exit_code" = 0 ] || fail "exit code $exit_code after the second SIGTERM"

step "SMOKE PASSED ($TARGET image $((size / 1000000)) MB)"
