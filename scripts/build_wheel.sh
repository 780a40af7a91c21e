#!/usr/bin/env bash
# Builds the `exactscore` Python wheel (python/: the extension module, the `exactscore` CLI binary
# and the WikiText-2 file) into $CARGO_TARGET_DIR/wheels (default target/wheels) and prints its
# path.
#
#   scripts/build_wheel.sh                      # release build: the wheel to publish (one per platform)
#   scripts/build_wheel.sh --profile wheel-ci   # CI's: the dev profile without debug info
#
# maturin cannot put a crate's binary and its Python extension module into one wheel, so cargo
# builds the CLI first and the wheel carries it as data: exactscore.data/scripts/ is installed
# into the environment's bin/ (on PATH), exactscore.data/data/share/exactscore/ into its share/,
# where the CLI and the Python module look for `wikitext2`. maturin comes from PyPI, pinned in
# scripts/requirements-wheel.txt, into a venv of its own under the target directory (made once,
# reused while the pin is unchanged); MATURIN=/path/to/maturin uses another one instead.
#
#   pip install "$(scripts/build_wheel.sh)"     # the CLI on PATH and the Python module
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
case "${1:-}" in
  --profile) profile="${2:?--profile needs a cargo profile}" ;;
  "" | --release) ;;
  *) echo "usage: $0 [--release | --profile NAME]" >&2; exit 2 ;;
esac
mkdir -p "${CARGO_TARGET_DIR:-target}"
target="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)"
profile_flags=(--profile "$profile")

if [ -z "${MATURIN:-}" ]; then
  tools="$target/maturin-venv"
  pins=scripts/requirements-wheel.txt
  if ! cmp -s "$pins" "$tools/requirements-wheel.txt"; then
    echo "installing the wheel tools of $pins into $tools" >&2
    rm -rf "$tools"
    python3 -m venv "$tools"
    "$tools/bin/pip" install -q -r "$pins" >&2
    cp "$pins" "$tools/requirements-wheel.txt"
  fi
  MATURIN="$tools/bin/maturin"
fi

# Selecting exactscore-python too gives the CLI's dependencies the features the extension's get:
# maturin's build below then reuses them instead of compiling them a second time.
cargo build -q "${profile_flags[@]}" --locked -p exactscore-python -p exactscore-client \
  --features exactscore-python/extension --bin exactscore
data=python/exactscore.data
rm -rf "$data"
mkdir -p "$data/scripts" "$data/data/share/exactscore"
out_dir="$profile"
[ "$profile" = dev ] && out_dir=debug  # cargo's name for the dev profile's folder
cp "$target/$out_dir/exactscore" "$data/scripts/exactscore"
cp tests/fixtures/corpus/wikitext-2-raw-test.txt.gz "$data/data/share/exactscore/"

out="$target/wheels"
rm -f "$out"/exactscore-*.whl
"$MATURIN" build --quiet "${profile_flags[@]}" --locked \
  --manifest-path python/Cargo.toml --out "$out" >&2
ls "$out"/exactscore-*.whl
