#!/usr/bin/env bash
# The wheel built from a fresh clone with an empty HOME, CARGO_HOME and caches, then tested (python/test-wheel.sh).
set -uo pipefail
tmp=/tmp/pristine-wheel
export RUSTUP_HOME=/root/.rustup
export PATH="/root/.cargo/bin:/usr/local/bin:/usr/bin:/bin"
mkdir -p $tmp/home
export HOME="$tmp/home" CARGO_HOME="$tmp/home/.cargo" PIP_NO_CACHE_DIR=1 XDG_CACHE_HOME="$tmp/home/.cache"
cd $tmp/clone
start=$SECONDS
python/build-wheel.sh
echo "build-wheel: exit $? in $((SECONDS - start)) s"
ls -la target/wheels
start=$SECONDS
python/test-wheel.sh "" "$tmp/log"
echo "test-wheel: exit $? in $((SECONDS - start)) s"
