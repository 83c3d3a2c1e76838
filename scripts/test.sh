#!/usr/bin/env bash
# The README's test command: sets up .venv on a fresh machine (torch 2.13.0 CPU first, so pip
# never pulls a CUDA build), installs the project with its test extras and a real SGLang 0.5.23
# (scripts/sglang_cpu/install.sh; tests/test_sglang_real.py runs it) and what the Slurm tests need
# (scripts/slurm_ci/install.sh), lints the tree with ruff
# (ruff.toml: check and format), runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --sglang
# The Slurm test cluster's host side (daemons, munge, fake GPU device nodes): root + apt-get, else skipped.
bash scripts/slurm_ci/install.sh
# The image's Megatron-Core (Dockerfile MEGATRON_CORE_VERSION; its wheels are Python 3.12 only, the
# package is pure Python) beside the venv's, for tests/test_trainer_packed.py's shipped-version run.
MC=$(sed -n 's/^ARG MEGATRON_CORE_VERSION=//p' Dockerfile)
[ -d ".venv/megatron-core-$MC/megatron/core" ] || .venv/bin/python -m pip install -q --no-deps \
  --target ".venv/megatron-core-$MC" --python-version 3.12 --only-binary=:all: "megatron-core==$MC"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
exec .venv/bin/python -m pytest -q "$@"
