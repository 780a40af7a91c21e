#!/usr/bin/env bash
# Builds and runs the Dockerfile's CPU target where Docker Hub cannot be reached but Debian's
# package mirror can: the two base images the CPU target needs are made locally.
#
#   exactscore-local/debian:bookworm   debootstrap --variant=minbase bookworm (the runtime base)
#   exactscore-local/rust:1.95         the same plus gcc/libc6-dev/ca-certificates, this
#                                      machine's Rust toolchain (rustc/cargo 1.95, no docs) and
#                                      its CA bundle (crates.io may sit behind an egress proxy)
#
# then `docker build --target cpu` with them as RUST_IMAGE / CPU_BASE_IMAGE (crates come from
# crates.io: the build runs with --network host), and a smoke test of the image: it turns
# healthy through its HEALTHCHECK, runs as uid 10001, scores a request, and exits 0 on
# `docker stop` (SIGTERM drain).
#
#   bash scripts/docker_local_bases.sh [bases|build|smoke|all]      (default all)
#
# Needs: root, a running Docker engine (Debian: apt-get install docker.io; without systemd start
# it with `dockerd --iptables=false --bridge=none &`), debootstrap (apt-get install debootstrap),
# rustup's toolchain on this machine. A release build of the server and client takes a while
# (about 10 minutes on 2 free cores).
set -euo pipefail
cd "$(dirname "$0")/.."

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WORK=${DOCKER_BASES_DIR:-$PWD/target/docker-bases}
DEBIAN_IMAGE=exactscore-local/debian:bookworm
RUST_IMAGE=exactscore-local/rust:1.95
TAG=${IMAGE_TAG:-exactscore:cpu}
step=${1:-all}

say() { printf '[docker-local] %s\n' "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

docker info >/dev/null 2>&1 || die "no Docker engine answers (docker info); see the header of this script"

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

bootstrap() { # dir [extra packages]
    local dir=$1 include=${2:-}
    [ -x "$dir/bin/sh" ] && return 0
    command -v debootstrap >/dev/null || die "debootstrap missing (apt-get install debootstrap)"
    rm -rf "$dir.tmp"
    say "debootstrap bookworm into $dir ${include:+(+ $include)}"
    debootstrap --variant=minbase ${include:+--include="$include"} bookworm "$dir.tmp" "$MIRROR" \
        >"$dir.log" 2>&1 || die "debootstrap failed, see $dir.log"
    rm -rf "$dir.tmp/var/cache/apt/archives/"*.deb "$dir.tmp/var/lib/apt/lists/"*
    mv "$dir.tmp" "$dir"
}

bases() {
    mkdir -p "$WORK"
    if ! image_exists "$DEBIAN_IMAGE"; then
        bootstrap "$WORK/debian"
        tar -C "$WORK/debian" -c . | docker import --change 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
        say "imported $DEBIAN_IMAGE"
    fi
    if ! image_exists "$RUST_IMAGE"; then
        bootstrap "$WORK/debian-build" gcc,libc6-dev,ca-certificates
        local tc
        tc=$(rustc --print sysroot)
        "$tc/bin/rustc" --version | grep -q '^rustc 1\.95\.' || die "need rustc 1.95 here, found $("$tc/bin/rustc" --version)"
        # The toolchain without its documentation, under /usr/local/rust.
        rm -rf "$WORK/rust-root" && mkdir -p "$WORK/rust-root/usr/local/rust"
        cp -a "$tc/bin" "$tc/lib" "$WORK/rust-root/usr/local/rust/"
        [ -d "$tc/libexec" ] && cp -a "$tc/libexec" "$WORK/rust-root/usr/local/rust/"
        rm -rf "$WORK/rust-root/usr/local/rust/lib/rustlib/src"
        # The builder fetches crates: it trusts the certificate authorities this machine trusts
        # (which may include a TLS-inspecting egress proxy's).
        cp /etc/ssl/certs/ca-certificates.crt "$WORK/debian-build/etc/ssl/certs/ca-certificates.crt"
        tar -C "$WORK/debian-build" -c . -C "$WORK/rust-root" usr/local/rust |
            docker import \
                --change 'ENV PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
                --change 'ENV CARGO_HOME=/usr/local/cargo' \
                --change 'ENV CARGO_HTTP_CAINFO=/etc/ssl/certs/ca-certificates.crt' \
                --change 'CMD ["bash"]' - "$RUST_IMAGE" >/dev/null
        say "imported $RUST_IMAGE ($(docker run --rm "$RUST_IMAGE" rustc --version))"
    fi
}

build() {
    say "docker build --target cpu -t $TAG (release build of server and client)"
    docker build --network host --target cpu \
        --build-arg RUST_IMAGE="$RUST_IMAGE" --build-arg CPU_BASE_IMAGE="$DEBIAN_IMAGE" \
        -t "$TAG" .
}

smoke() {
    local port name=exactscore-smoke-$$ status i
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    docker rm -f "$name" >/dev/null 2>&1 || true
    # Host networking: the engine may run without a bridge here; the server binds 127.0.0.1.
    docker run -d --name "$name" --network host \
        -e EXACTSCORE_HOST=127.0.0.1 -e EXACTSCORE_PORT="$port" -e EXACTSCORE_API_KEY=smoke-key \
        --health-interval 2s --health-start-period 120s "$TAG" >/dev/null
    # shellcheck disable=SC2064  # the name is fixed now; the trap outlives this function
    trap "docker rm -f '$name' >/dev/null 2>&1 || true" EXIT
    for i in $(seq 1 120); do
        status=$(docker inspect -f '{{.State.Health.Status}}' "$name")
        [ "$status" = healthy ] && break
        [ "$(docker inspect -f '{{.State.Running}}' "$name")" = true ] || { docker logs "$name" >&2; die "container exited"; }
        sleep 1
    done
    [ "$status" = healthy ] || { docker logs "$name" >&2; die "not healthy after 120 s ($status)"; }
    say "healthy after ${i} s (HEALTHCHECK: exactscore-server --healthcheck)"
    [ "$(docker exec "$name" id -u)" = 10001 ] || die "the server does not run as uid 10001"
    local body
    body=$(python3 - "$port" <<'PY'
import json, sys, urllib.request
req = urllib.request.Request(
    f"http://127.0.0.1:{sys.argv[1]}/score",
    data=json.dumps({"tokens": [1992, 51, 78, 354]}).encode(),
    headers={"Authorization": "Bearer smoke-key", "Content-Type": "application/json"})
print(urllib.request.urlopen(req, timeout=60).read().decode())
PY
)
    python3 -c 'import json, sys; s = json.loads(sys.argv[1])["sequences"][0]; assert s["num_scored"] == 3 and s["token_logprobs"][0] is None, s; print("[docker-local] /score:", s["token_logprobs"])' "$body"
    docker stop -t 60 "$name" >/dev/null
    local code
    code=$(docker inspect -f '{{.State.ExitCode}}' "$name")
    [ "$code" = 0 ] || { docker logs "$name" >&2; die "exit code $code after docker stop"; }
    say "docker stop: drained, exit 0"
    docker run --rm --entrypoint exactscore "$TAG" --version >/dev/null || die "client missing in the image"
    say "smoke test passed ($TAG, $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
}

case "$step" in
    bases) bases ;;
    build) build ;;
    smoke) smoke ;;
    all) bases; build; smoke ;;
    *) die "unknown step $step (bases|build|smoke|all)" ;;
esac
