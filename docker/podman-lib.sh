# Podman on this kind of machine (../shared/CONTAINERS.md), for docker/build-and-smoke.sh and
# docker/scale-smoke.sh: host tools, an engine config outside /etc, a debootstrap base image (no
# registry), and the kvserve image: CPU with torch from a local wheelhouse, or the default (CUDA) one.
# Expects ROOT, SCRATCH, PY and the functions step and fail; exports CONTAINERS_CONF.

BASE_TAG=docker.io/library/debian:bookworm-slim

podman_setup() {
    step "host tools (podman, runc, debootstrap, catatonit)"
    if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap catatonit >/dev/null
    fi
    mkdir -p "$SCRATCH"
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; then nproc=32768; fi
    printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n[engine]\nruntime = "runc"\n' \
        "$nofile" "$nofile" "$nproc" "$nproc" >"$SCRATCH/containers.conf"
    export CONTAINERS_CONF="$SCRATCH/containers.conf"
    podman --version
}

podman_base() {
    step "base image $BASE_TAG (debootstrap; made once)"
    if ! podman image exists "$BASE_TAG"; then
        rootfs="$SCRATCH/rootfs"
        rm -rf "$rootfs"
        mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
            | grep -oE 'https?://[^ ]+/debian/?$' | head -n1 || true)
        debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/dev/null
        # Build steps reach PyPI through this host's intercepting proxy: trust its CAs inside the base.
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
        chroot "$rootfs" update-ca-certificates >/dev/null
        printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb http://deb.debian.org/debian-security bookworm-security main\n' \
            "${mirror:-http://deb.debian.org/debian}" "${mirror:-http://deb.debian.org/debian}" >"$rootfs/etc/apt/sources.list"
        tar -C "$rootfs" -c . | podman import - localhost/debian-base:bookworm >/dev/null
        podman tag localhost/debian-base:bookworm "$BASE_TAG"
        rm -rf "$rootfs"
    fi
}

podman_build_kvserve() {  # $1: the image tag; $2: the variant, cpu (default) or cuda (the Dockerfile's default)
    variant=${2:-cpu}
    if [ "$variant" = cpu ]; then
        step "wheelhouse: this machine's CPU torch wheel"
        find "$ROOT/docker/wheelhouse" -name '*.whl' -delete
        "$PY" -m pip download --quiet --no-deps --only-binary :all: torch==2.13.0 -d "$ROOT/docker/wheelhouse"
        ls -1 "$ROOT/docker/wheelhouse"/*.whl
    fi
    # cuda: torch and its nvidia-* wheels come from PyPI (several GB); the wheelhouse is not used.

    step "podman build (BASE=$variant)"
    build_start=$(date +%s)
    podman build --format docker --build-arg BASE="$variant" -t "$1" "$ROOT"
    echo "image $1: $(($(podman image inspect "$1" --format '{{.Size}}') / 1000000)) MB, built in $(($(date +%s) - build_start)) s"
}
