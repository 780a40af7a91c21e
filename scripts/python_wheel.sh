#!/usr/bin/env bash
# CI step for the Python wheel: builds it with maturin from PyPI (scripts/build_wheel.sh
# --profile wheel-ci), installs it into a fresh venv, checks that `exactscore --help` runs from
# PATH, and runs python/tests (pytest) against the debug server binary (`cargo test` builds it;
# EXACTSCORE_SERVER_BIN to use another) on the bundled tiny model, among them one `Client.diff`
# and one `exactscore.compare` against a server with a reference model. build_wheel.sh installs
# its own maturin (scripts/requirements-wheel.txt); the test venv is made anew every run.
#
# Cost on a fresh target/ (as in CI): 407 s user + 29 s system CPU, of which the build (profile
# wheel-ci: the extension's dependencies compiled once more, see Cargo.toml) is nearly all;
# install 19 s, tests 11 s; a 13 MB wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${CARGO_TARGET_DIR:-target}"
target="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)"
start=$(date +%s)
wheel="$(bash scripts/build_wheel.sh --profile wheel-ci)"
built=$(date +%s)

venv="$target/wheel-test-venv"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q "$wheel" pytest==9.2.0 numpy==2.4.6 pandas==3.1.1
# The CLI from PATH, as a shell finds it after `pip install` in an activated venv.
(PATH="$venv/bin:$PATH"; hash -r; [ "$(command -v exactscore)" = "$venv/bin/exactscore" ] &&
  exactscore --help >/dev/null && echo "exactscore --help: ok ($(command -v exactscore))")
installed=$(date +%s)

PATH="$venv/bin:$PATH" EXACTSCORE_SERVER_BIN="${EXACTSCORE_SERVER_BIN:-$target/debug/exactscore-server}" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests
echo "python wheel: built in $((built - start)) s, installed in $((installed - built)) s," \
  "tested in $(($(date +%s) - installed)) s ($(du -h "$wheel" | cut -f1) wheel)"
