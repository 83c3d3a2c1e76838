#!/usr/bin/env bash
# The aarch64 cross compiler tests/test_cpu_build.py compiles the C kernels with (compile only, against
# this venv's torch headers): Debian's g++-aarch64-linux-gnu, installed by the test command
# (scripts/test.sh). Needs root and apt-get; without them it says so and the aarch64 test skips
# naming this script. Idempotent.
set -euo pipefail
command -v aarch64-linux-gnu-g++ >/dev/null && exit 0
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "scripts/cross/install.sh: needs root and apt-get; the aarch64 compile test will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu >/dev/null 2>&1; then
  apt-get update -qq >/dev/null 2>&1 || true  # a stale package index: refresh once
  apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu >/dev/null 2>&1 ||
    echo "scripts/cross/install.sh: apt-get could not install g++-aarch64-linux-gnu; the aarch64 compile test will skip" >&2
fi
