#!/usr/bin/env bash
# Creates .venv with torch first (the CPU build on a CPU box), then the project and its dev extras.
# `--sglang` (what scripts/test.sh passes) also installs a real SGLang 0.5.23 for the tests
# (scripts/sglang_cpu/install.sh); the main job does not need it.
# Idempotent: a second run only re-checks the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
# rollout.reward=code runs model-written code only inside bubblewrap (megatron_trace/data/sandbox.py).
# Installed where this runs as root with apt-get; elsewhere the reward says at load how to get it.
if ! command -v bwrap >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1 ||
        echo "setup_env.sh: could not install bubblewrap (rollout.reward=code needs it)" >&2
fi
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
[ "${1:-}" != "--sglang" ] || bash scripts/sglang_cpu/install.sh
