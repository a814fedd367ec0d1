#!/usr/bin/env bash
# The README's two commands as a new user runs them: a fresh clone of COMMIT (default HEAD) with an empty HOME,
# CARGO_HOME and cache folders (every crate and wheel downloaded again), then `cargo run --release -- sim` and
# `cargo test`, each timed. Prints the verdict line, each test binary's result, and the two wall times.
#   usage: bench/readme-commands.sh [COMMIT] [--keep]
# Run it on a quiet machine: the two cores are the measurement.
set -uo pipefail
commit=HEAD; keep=0
for a in "$@"; do case "$a" in --keep) keep=1;; -*) echo "usage: $0 [COMMIT] [--keep]"; exit 2;; *) commit=$a;; esac; done
src=$(git -C "$(dirname "$0")" rev-parse --show-toplevel) || exit 2
rev=$(git -C "$src" rev-parse --short "$commit") || exit 2
tmp=$(mktemp -d -t readme-commands.XXXXXX)
git clone -q "$src" "$tmp/project" && git -C "$tmp/project" checkout -q "$rev" || { echo "clone failed"; exit 2; }
export RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
export HOME="$tmp/home" CARGO_HOME="$tmp/home/.cargo" PIP_NO_CACHE_DIR=1 XDG_CACHE_HOME="$tmp/home/.cache"
unset CARGO_TARGET_DIR KVSIM_CACHE_DIR
mkdir -p "$HOME"
cd "$tmp/project" || exit 2
echo "readme-commands: $rev in $tmp, started $(date -u +%FT%TZ), $(nproc) cores"
rc_all=0
s=$(date +%s); cargo run --release -- sim >"$tmp/run.log" 2>&1; rc=$?; e=$(date +%s)
echo "run command (cargo run --release -- sim): exit $rc, $((e - s)) s"
grep "kvsim sim:" "$tmp/run.log"
[ $rc = 0 ] || rc_all=1
s=$(date +%s); cargo test >"$tmp/test.log" 2>&1; rc=$?; e=$(date +%s)
echo "test command (cargo test): exit $rc, $((e - s)) s"
grep -E "Finished|^test result: ok\. [1-9]|FAILED|panicked" "$tmp/test.log"
[ $rc = 0 ] || rc_all=1
if [ $rc_all = 0 ] && [ $keep = 0 ]; then rm -rf "$tmp"; else echo "logs kept in $tmp"; fi
exit $rc_all
