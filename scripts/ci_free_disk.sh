#!/usr/bin/env bash
# Frees what a finished CI step leaves behind on the small CI disk, and prints the disk's state.
#
#   scripts/ci_free_disk.sh test-binaries TARGET   # the linked test executables in TARGET/debug/deps
#   scripts/ci_free_disk.sh wheel TARGET           # the wheel's build profile and its venvs
#
# test-binaries keeps TARGET/debug/exactscore-server (a hard link, so removing its twin in deps/
# frees nothing but breaks nothing) and every .rlib/.rmeta: a later `cargo build` relinks only.
set -euo pipefail
what="${1:?test-binaries|wheel}"
target="${2:?target directory}"
before=$(du -sm "$target" | cut -f1)
case "$what" in
  test-binaries)
    find "$target/debug/deps" -maxdepth 1 -type f -perm -u+x ! -name '*.so' -delete ;;
  wheel)
    rm -rf "$target/wheel-ci" "$target/wheel-test-venv" "$target/maturin-venv" ;;
  *) echo "ci_free_disk.sh: unknown step '$what' (test-binaries|wheel)" >&2; exit 2 ;;
esac
after=$(du -sm "$target" | cut -f1)
echo "ci_free_disk.sh $what: $target $before MB -> $after MB; $(df -h "$target" | awk 'NR==2 {print $4}') free"
