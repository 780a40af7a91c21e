#!/usr/bin/env bash
# Shows that the `exactscore` wheel installs and works where there is no Rust: a minimal Debian
# chroot (debootstrap, Python from Debian, no cargo/rustc) gets a fresh venv, `pip install WHEEL`,
# then the CLI from PATH and the Python module run against a server on this machine's loopback
# (the chroot shares the network), on WikiText-2 from the wheel itself. Needs root, debootstrap
# and about 300 MB; not part of CI (it downloads a Debian base system).
#
#   scripts/wheel_without_rust.sh WHEEL URL [API_KEY]
#
# SUITE (default trixie: CPython 3.13, glibc 2.41) picks the Debian release; CHROOT (default
# target/wheel-chroot-$SUITE) where it is made, once.
set -euo pipefail
wheel="$(realpath "${1:?usage: $0 WHEEL URL [API_KEY]}")"
url="${2:?usage: $0 WHEEL URL [API_KEY]}"
key="${3:-}"
cd "$(dirname "$0")/.."
suite="${SUITE:-trixie}"
root="$(realpath -m "${CHROOT:-${CARGO_TARGET_DIR:-target}/wheel-chroot-$suite}")"
if [ ! -x "$root/usr/bin/python3" ]; then
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$root" \
    http://deb.debian.org/debian >/dev/null
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
# Where this machine's pip trusts its own certificate bundle (a TLS proxy), the chroot's does too.
cert=""
if [ -n "${PIP_CERT:-}" ]; then cp "$PIP_CERT" "$root/etc/host-ca.pem"; cert=/etc/host-ca.pem; fi
mkdir -p "$root/wheel"
# /proc, as on any machine (the CLI finds its data beside /proc/self/exe).
mount -t proc proc "$root/proc"
trap 'umount "$root/proc"' EXIT
rm -f "$root"/wheel/*.whl
cp "$wheel" "$root/wheel/"
chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root URL="$url" KEY="$key" PIP_CERT="$cert" bash -euo pipefail -c '
. /etc/os-release
echo "chroot: $PRETTY_NAME, $(python3 --version), glibc $(getconf GNU_LIBC_VERSION | cut -d" " -f2)"
if command -v cargo || command -v rustc || [ -e /root/.cargo ]; then echo "Rust is here" >&2; exit 1; fi
echo "no cargo, no rustc, no ~/.cargo"
rm -rf /opt/venv && python3 -m venv /opt/venv
[ -n "$PIP_CERT" ] || unset PIP_CERT
/opt/venv/bin/pip install -q /wheel/*.whl
. /opt/venv/bin/activate
echo "exactscore on PATH: $(command -v exactscore)"
cd /tmp
exactscore ppl --server "$URL" ${KEY:+--api-key "$KEY"} --dataset wikitext2 --ctx 64 --stride 32 \
  --max-windows 8 --no-progress --json /tmp/cli.json | grep perplexity
python - <<EOF
import json, os
import exactscore
c = exactscore.Client(os.environ["URL"], api_key=os.environ["KEY"] or None)
print("python: exactscore", exactscore.__version__, "score:", c.score("The capital of France is Paris."))
r = c.ppl("wikitext2", ctx=64, stride=32, max_windows=8, progress=False)
cli = json.load(open("/tmp/cli.json"))
assert r.per_window == cli["per_window"] and r.perplexity == cli["perplexity"], "CLI and Python differ"
print("python ppl:", r.perplexity, "equal to the CLI report; wikitext2 from", exactscore._support.wikitext_path())
EOF
'
